//! Waiting for something to hold: polling, with a deadline.

use std::future::Future;
use std::time::{Duration, Instant};

/// Calls `probe` every `every` until it gives `Ok`, for at most `timeout` (it is always called at
/// least once): its value, or the last `Err` once `timeout` has passed, for the caller to report.
pub async fn until<T, E, F, Fut>(timeout: Duration, every: Duration, mut probe: F) -> Result<T, E>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Result<T, E>>,
{
    let start = Instant::now();
    loop {
        match probe().await {
            Ok(done) => return Ok(done),
            Err(last) if start.elapsed() >= timeout => return Err(last),
            Err(_) => tokio::time::sleep(every).await,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn it_polls_until_the_probe_holds() {
        let mut calls = 0;
        let got = until(Duration::from_secs(5), Duration::from_millis(1), || {
            calls += 1;
            let n = calls;
            async move {
                if n == 3 {
                    Ok(n)
                } else {
                    Err(n)
                }
            }
        })
        .await;
        assert_eq!(got, Ok(3));
    }

    #[tokio::test]
    async fn after_the_timeout_it_gives_the_last_failure() {
        let mut calls = 0;
        let got: Result<(), u32> =
            until(Duration::from_millis(30), Duration::from_millis(5), || {
                calls += 1;
                let n = calls;
                async move { Err(n) }
            })
            .await;
        assert!(matches!(got, Err(n) if n > 1), "{got:?}");
    }
}
