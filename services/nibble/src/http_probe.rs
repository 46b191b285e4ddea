//! Whether an address `nibble generate --url` failed to speak gRPC with answers plain HTTP/1
//! instead: the router's OpenAI API port (axum answers a gRPC call there too, over HTTP/2, with
//! a 404 that reads as a garbled gRPC error), so the user is told which port to use.

use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// How long the probe may take, in all.
const PROBE_TIMEOUT: Duration = Duration::from_secs(2);

/// Whether the server at `url` (`host:port` or `http://host:port`) answers an HTTP/1.1 request
/// with an HTTP/1 response. `https://` addresses are not probed (false).
pub async fn answers_http1(url: &str) -> bool {
    if url.starts_with("https://") {
        return false;
    }
    let authority = url
        .strip_prefix("http://")
        .unwrap_or(url)
        .trim_end_matches('/');
    let probe = async {
        let mut tcp = tokio::net::TcpStream::connect(authority).await.ok()?;
        let request = format!("GET / HTTP/1.1\r\nHost: {authority}\r\nConnection: close\r\n\r\n");
        tcp.write_all(request.as_bytes()).await.ok()?;
        let mut head = [0u8; 8];
        tcp.read_exact(&mut head).await.ok()?;
        Some(head.starts_with(b"HTTP/1."))
    };
    matches!(
        tokio::time::timeout(PROBE_TIMEOUT, probe).await,
        Ok(Some(true))
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn an_http1_server_is_told_from_a_silent_one() {
        let http = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let address = http.local_addr().unwrap();
        tokio::spawn(async move {
            let (mut tcp, _) = http.accept().await.unwrap();
            let mut buf = [0u8; 256];
            let _ = tcp.read(&mut buf).await;
            let _ = tcp
                .write_all(b"HTTP/1.1 404 Not Found\r\ncontent-length: 0\r\n\r\n")
                .await;
        });
        assert!(answers_http1(&address.to_string()).await);

        // A server that answers something else (an HTTP/2 frame, say) is not HTTP/1.
        let other = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let address = other.local_addr().unwrap();
        tokio::spawn(async move {
            let (mut tcp, _) = other.accept().await.unwrap();
            let _ = tcp.write_all(&[0, 0, 0, 4, 0, 0, 0, 0, 0]).await;
        });
        assert!(!answers_http1(&format!("http://{address}")).await);
        assert!(!answers_http1(&format!("https://{address}")).await);
    }
}
