//! A minimal HTTP/1.1 client over a raw socket, enough to drive the router's HTTP API in tests
//! and to see its bytes as sent (status line, headers, chunked body, server-sent events).

use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

/// A whole response.
#[derive(Debug)]
pub struct HttpResponse {
    pub status: u16,
    /// Header names lower-cased.
    pub headers: Vec<(String, String)>,
    /// The body, de-chunked.
    pub body: Vec<u8>,
}

impl HttpResponse {
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(n, _)| n == name)
            .map(|(_, v)| v.as_str())
    }

    pub fn text(&self) -> String {
        String::from_utf8(self.body.clone()).expect("a UTF-8 body")
    }

    pub fn json(&self) -> serde_json::Value {
        serde_json::from_slice(&self.body)
            .unwrap_or_else(|e| panic!("not JSON ({e}): {:?}", self.text()))
    }

    /// The `data:` payloads of a server-sent-event body, in order.
    pub fn sse_data(&self) -> Vec<String> {
        sse_data(&self.text())
    }
}

/// The `data:` payloads of server-sent events (comments and other fields skipped).
pub fn sse_data(text: &str) -> Vec<String> {
    assert!(
        text.is_empty() || text.ends_with("\n\n"),
        "events end with a blank line: {text:?}"
    );
    text.split("\n\n")
        .filter(|event| !event.is_empty())
        .filter_map(|event| {
            let data: Vec<&str> = event
                .lines()
                .filter_map(|line| line.strip_prefix("data: "))
                .collect();
            (!data.is_empty()).then(|| data.join("\n"))
        })
        .collect()
}

/// Writes a request on a new connection and returns the connection (to read a stream from it,
/// or to drop it midway).
pub async fn send(
    address: &str,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
    body: Option<&[u8]>,
) -> TcpStream {
    let mut stream = TcpStream::connect(address).await.unwrap();
    let mut head = format!("{method} {path} HTTP/1.1\r\nHost: {address}\r\nConnection: close\r\n");
    for (name, value) in headers {
        head.push_str(&format!("{name}: {value}\r\n"));
    }
    if let Some(body) = body {
        head.push_str(&format!(
            "Content-Type: application/json\r\nContent-Length: {}\r\n",
            body.len()
        ));
    }
    head.push_str("\r\n");
    stream.write_all(head.as_bytes()).await.unwrap();
    if let Some(body) = body {
        stream.write_all(body).await.unwrap();
    }
    stream
}

/// Sends a request and reads the whole response.
pub async fn request(
    address: &str,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
    body: Option<&[u8]>,
) -> HttpResponse {
    let mut stream = send(address, method, path, headers, body).await;
    let mut raw = Vec::new();
    tokio::time::timeout(Duration::from_secs(120), stream.read_to_end(&mut raw))
        .await
        .expect("the response ends within two minutes")
        .unwrap();
    parse(&raw)
}

/// `POST`s a JSON body.
pub async fn post_json(address: &str, path: &str, body: &serde_json::Value) -> HttpResponse {
    let body = body.to_string();
    request(address, "POST", path, &[], Some(body.as_bytes())).await
}

/// `GET`s a path.
pub async fn get(address: &str, path: &str) -> HttpResponse {
    request(address, "GET", path, &[], None).await
}

/// Parses a whole response.
pub fn parse(raw: &[u8]) -> HttpResponse {
    let split = raw
        .windows(4)
        .position(|w| w == b"\r\n\r\n")
        .unwrap_or_else(|| panic!("no end of headers in {:?}", String::from_utf8_lossy(raw)));
    let head = std::str::from_utf8(&raw[..split]).unwrap();
    let mut lines = head.split("\r\n");
    let status_line = lines.next().unwrap();
    let status = status_line
        .split(' ')
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| panic!("bad status line {status_line:?}"));
    let headers: Vec<(String, String)> = lines
        .filter_map(|line| line.split_once(':'))
        .map(|(n, v)| (n.trim().to_ascii_lowercase(), v.trim().to_string()))
        .collect();
    let rest = &raw[split + 4..];
    let chunked = headers
        .iter()
        .any(|(n, v)| n == "transfer-encoding" && v.eq_ignore_ascii_case("chunked"));
    let body = if chunked {
        dechunk(rest)
    } else {
        rest.to_vec()
    };
    HttpResponse {
        status,
        headers,
        body,
    }
}

fn dechunk(mut rest: &[u8]) -> Vec<u8> {
    let mut body = Vec::new();
    loop {
        let line_end = rest
            .windows(2)
            .position(|w| w == b"\r\n")
            .expect("a chunk size line");
        let size_text = std::str::from_utf8(&rest[..line_end]).unwrap();
        let size = usize::from_str_radix(size_text.split(';').next().unwrap().trim(), 16)
            .unwrap_or_else(|_| panic!("bad chunk size {size_text:?}"));
        rest = &rest[line_end + 2..];
        if size == 0 {
            return body;
        }
        body.extend_from_slice(&rest[..size]);
        rest = &rest[size + 2..];
    }
}
