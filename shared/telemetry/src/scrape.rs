//! Reading an endpoint back: [`scrape`] fetches `/metrics` over plain HTTP and [`Samples`]
//! parses the text exposition into samples to look up by name and labels. For tests and
//! tools; Prometheus itself is the real reader.

use std::net::SocketAddr;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

/// One sample: `name{labels} value`.
#[derive(Debug, Clone, PartialEq)]
pub struct Sample {
    pub name: String,
    pub labels: Vec<(String, String)>,
    pub value: f64,
}

/// Every sample of one exposition.
#[derive(Debug, Clone, Default)]
pub struct Samples(pub Vec<Sample>);

impl Samples {
    /// Parses the text exposition format (comments skipped; label values may not contain
    /// `,` or `}`, which nibble's never do).
    pub fn parse(text: &str) -> Self {
        let samples = text
            .lines()
            .filter(|l| !l.starts_with('#') && !l.trim().is_empty())
            .filter_map(|line| {
                let (series, value) = line.rsplit_once(' ')?;
                let value = value.parse().ok()?;
                let (name, labels) = match series.split_once('{') {
                    None => (series, Vec::new()),
                    Some((name, rest)) => {
                        let labels = rest
                            .trim_end_matches('}')
                            .split(',')
                            .filter(|pair| !pair.is_empty())
                            .filter_map(|pair| {
                                let (k, v) = pair.split_once('=')?;
                                Some((k.to_string(), v.trim_matches('"').to_string()))
                            })
                            .collect();
                        (name, labels)
                    }
                };
                Some(Sample {
                    name: name.to_string(),
                    labels,
                    value,
                })
            })
            .collect();
        Self(samples)
    }

    /// The samples named `name` whose labels include every pair of `labels`.
    pub fn matching<'a>(
        &'a self,
        name: &'a str,
        labels: &'a [(&'a str, &'a str)],
    ) -> impl Iterator<Item = &'a Sample> + 'a {
        self.0.iter().filter(move |s| {
            s.name == name
                && labels
                    .iter()
                    .all(|(k, v)| s.labels.iter().any(|(sk, sv)| sk == k && sv == v))
        })
    }

    /// The sum of the matching samples' values; `None` when none matches.
    pub fn get(&self, name: &str, labels: &[(&str, &str)]) -> Option<f64> {
        self.matching(name, labels)
            .map(|s| s.value)
            .reduce(|a, b| a + b)
    }

    /// [`get`](Self::get), or a panic that lists the series of that name.
    pub fn value(&self, name: &str, labels: &[(&str, &str)]) -> f64 {
        self.get(name, labels).unwrap_or_else(|| {
            let present: Vec<&Sample> = self.0.iter().filter(|s| s.name == name).collect();
            panic!("no sample {name} with labels {labels:?}; samples of that name: {present:?}")
        })
    }
}

/// Fetches `GET /metrics` from `address` and returns the body. Errors on a status other than
/// 200.
pub async fn scrape(address: SocketAddr) -> std::io::Result<String> {
    let mut stream = TcpStream::connect(address).await?;
    stream
        .write_all(format!("GET /metrics HTTP/1.0\r\nHost: {address}\r\n\r\n").as_bytes())
        .await?;
    let mut response = String::new();
    stream.read_to_string(&mut response).await?;
    let (head, body) = response
        .split_once("\r\n\r\n")
        .ok_or_else(|| std::io::Error::other(format!("not an HTTP response: {response:?}")))?;
    if !head.starts_with("HTTP/1.0 200") && !head.starts_with("HTTP/1.1 200") {
        return Err(std::io::Error::other(format!("GET /metrics: {head}")));
    }
    Ok(body.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_samples_and_sums_by_labels() {
        let text = "# HELP x_total Things.\n# TYPE x_total counter\n\
                    x_total{role=\"prefill\",direction=\"sent\"} 3\n\
                    x_total{role=\"decode\",direction=\"received\"} 4\n\
                    y_seconds_count 2\ny_seconds_sum 0.5\n";
        let s = Samples::parse(text);
        assert_eq!(s.value("x_total", &[("role", "prefill")]), 3.0);
        assert_eq!(s.value("x_total", &[]), 7.0);
        assert_eq!(s.value("y_seconds_count", &[]), 2.0);
        assert_eq!(s.get("x_total", &[("role", "router")]), None);
    }
}
