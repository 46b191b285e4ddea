//! The process's open-file limit, which bounds the connections the router can hold: every
//! connection is a file. [`raise_open_file_limit`] lifts the soft limit to the hard one at
//! start-up (as Go's runtime and nginx's `worker_rlimit_nofile` do: a soft limit of 1,024 is a
//! shell default, not a decision), and [`default_max_connections`] gives the HTTP API half of
//! what results, leaving the other half to the gRPC API, the workers, etcd and the model's files.

/// The HTTP API's connection cap when the open-file limit cannot be read.
pub const DEFAULT_MAX_CONNECTIONS: usize = 4096;
/// The default cap never goes below this (a tiny limit leaves the rest to its owner's care)...
pub const MIN_DEFAULT_MAX_CONNECTIONS: usize = 256;
/// ... nor above this: an idle connection costs memory too (tens of KiB with its buffers), and
/// past the cap idle ones make room for new ones rather than lock them out.
pub const MAX_DEFAULT_MAX_CONNECTIONS: usize = 65_536;

/// The HTTP API's default connection cap for an open-file limit of `limit` (`None`: unknown):
/// half of it, within [`MIN_DEFAULT_MAX_CONNECTIONS`]..=[`MAX_DEFAULT_MAX_CONNECTIONS`].
pub fn default_max_connections(limit: Option<u64>) -> usize {
    match limit {
        None => DEFAULT_MAX_CONNECTIONS,
        Some(limit) => usize::try_from(limit / 2)
            .unwrap_or(usize::MAX)
            .clamp(MIN_DEFAULT_MAX_CONNECTIONS, MAX_DEFAULT_MAX_CONNECTIONS),
    }
}

/// The process's soft open-file limit (`RLIMIT_NOFILE`), or `None` where it cannot be read or
/// is unlimited.
pub fn open_file_limit() -> Option<u64> {
    limits().map(|(soft, _)| wide(soft))
}

/// Raises the soft open-file limit to the hard limit; returns the soft limit in force after
/// (unchanged where it could not be raised, which is logged).
pub fn raise_open_file_limit() -> Option<u64> {
    let (soft, hard) = limits()?;
    if soft >= hard {
        return Some(wide(soft));
    }
    let raised = libc::rlimit {
        rlim_cur: hard,
        rlim_max: hard,
    };
    // SAFETY: `setrlimit` reads the struct we pass, which lives across the call.
    if unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &raised) } != 0 {
        let err = std::io::Error::last_os_error();
        tracing::warn!(%err, soft = wide(soft), hard = wide(hard),
            "could not raise the open-file limit to its hard limit");
        return Some(wide(soft));
    }
    tracing::debug!(
        from = wide(soft),
        to = wide(hard),
        "raised the open-file limit"
    );
    Some(wide(hard))
}

/// The soft and hard `RLIMIT_NOFILE` (an unlimited hard limit read as the soft one), unless
/// unreadable or unlimited.
fn limits() -> Option<(libc::rlim_t, libc::rlim_t)> {
    let mut current = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: `getrlimit` writes into the struct we pass, which lives across the call.
    if unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut current) } != 0 {
        return None;
    }
    if current.rlim_cur == libc::RLIM_INFINITY {
        return None;
    }
    let hard = match current.rlim_max {
        libc::RLIM_INFINITY => current.rlim_cur,
        hard => hard,
    };
    Some((current.rlim_cur, hard))
}

/// An `rlim_t` (64 bits on Linux) as a `u64`.
#[allow(clippy::unnecessary_cast, clippy::useless_conversion)]
fn wide(limit: libc::rlim_t) -> u64 {
    limit as u64
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_default_cap_is_half_the_open_file_limit_within_bounds() {
        assert_eq!(default_max_connections(None), DEFAULT_MAX_CONNECTIONS);
        assert_eq!(default_max_connections(Some(20_000)), 10_000);
        assert_eq!(default_max_connections(Some(1_024)), 512);
        assert_eq!(default_max_connections(Some(100)), 256);
        assert_eq!(default_max_connections(Some(1 << 20)), 65_536);
    }

    #[test]
    fn the_raised_limit_is_the_hard_one() {
        let (_, hard) = limits().expect("RLIMIT_NOFILE is readable here");
        assert_eq!(raise_open_file_limit(), Some(wide(hard)));
        assert_eq!(open_file_limit(), Some(wide(hard)));
    }
}
