//! Command-line helpers the examples share (each includes this file with `#[path]`).

/// A comma-separated list of values, each parsed, naming the one that does not parse.
pub fn list<T: std::str::FromStr>(s: &str) -> anyhow::Result<Vec<T>>
where
    T::Err: std::fmt::Display,
{
    s.split(',')
        .map(|x| x.trim().parse().map_err(|e| anyhow::anyhow!("`{x}`: {e}")))
        .collect()
}
