//! [`TaskGuard`]: a background task that lives exactly as long as its owner.

use tokio::task::JoinHandle;

/// Aborts the task when dropped.
#[derive(Debug)]
pub(crate) struct TaskGuard(JoinHandle<()>);

impl TaskGuard {
    /// Spawns `future` on the current runtime.
    ///
    /// # Panics
    /// Outside a tokio runtime.
    pub(crate) fn spawn(future: impl std::future::Future<Output = ()> + Send + 'static) -> Self {
        Self(tokio::spawn(future))
    }
}

impl Drop for TaskGuard {
    fn drop(&mut self) {
        self.0.abort();
    }
}
