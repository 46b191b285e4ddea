//! Binding a process's listeners, with errors an operator can act on: the flag that gave the
//! address, and `is already in use` when another process holds the port. Every binary binds
//! all its listeners this way before it loads a model, so a taken port fails in a moment.

use std::net::SocketAddr;

use tokio::net::TcpListener;

/// Binds `address`, which the flag `flag` (`--listen`, `--http-listen`, ...) gave. The error
/// names both: `--http-listen 127.0.0.1:8000 is already in use`, or `--listen ADDR: <cause>`.
pub async fn bind(flag: &str, address: SocketAddr) -> std::io::Result<TcpListener> {
    TcpListener::bind(address)
        .await
        .map_err(|e| named(flag, address, e))
}

/// [`bind`] for a blocking caller (a listener to hand to a runtime later).
pub fn bind_std(flag: &str, address: SocketAddr) -> std::io::Result<std::net::TcpListener> {
    let listener = std::net::TcpListener::bind(address).map_err(|e| named(flag, address, e))?;
    listener.set_nonblocking(true)?;
    Ok(listener)
}

fn named(flag: &str, address: SocketAddr, error: std::io::Error) -> std::io::Error {
    let message = match error.kind() {
        std::io::ErrorKind::AddrInUse => format!("{flag} {address} is already in use"),
        _ => format!("{flag} {address}: {error}"),
    };
    std::io::Error::new(error.kind(), message)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_taken_port_is_named_with_its_flag() {
        let taken = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let address = taken.local_addr().unwrap();
        let err = bind("--http-listen", address).await.unwrap_err();
        assert_eq!(err.kind(), std::io::ErrorKind::AddrInUse);
        assert_eq!(
            err.to_string(),
            format!("--http-listen {address} is already in use")
        );
        let err = bind_std("--listen", address).unwrap_err();
        assert_eq!(
            err.to_string(),
            format!("--listen {address} is already in use")
        );
    }
}
