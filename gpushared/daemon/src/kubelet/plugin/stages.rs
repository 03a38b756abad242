//! Where a kubelet call's time went inside gpushared, logged at debug level when the call is
//! answered or refused (`kubelet call done`, target `gpushared::kubelet::plugin::stages`): the
//! runs of the allocator on the blocking pool, the kubelet's PodResources asked, the
//! consistent reads of the node's pods, and the waits for the pod watch or the allocations.
//! The kubelet and a read run side by side while a call confirms its pod, so the stages may
//! add up to more than the whole.

use std::future::Future;
use std::time::{Duration, Instant};

/// One call's stages, accumulated over its rounds.
#[derive(Debug)]
pub(super) struct Stages {
    started: Instant,
    /// Runs of the allocator.
    pub(super) runs: u32,
    /// Time in those runs, including the wait for a blocking thread.
    pub(super) run: Duration,
    /// Time asking the kubelet's PodResources `List`.
    pub(super) kubelet: Duration,
    /// Time in consistent reads of the node's pods (by name or by list).
    pub(super) read: Duration,
    /// Time waiting for a change of the pods or allocations, or to try again.
    pub(super) waited: Duration,
}

impl Stages {
    /// A call that starts now.
    pub(super) fn start() -> Self {
        Stages {
            started: Instant::now(),
            runs: 0,
            run: Duration::ZERO,
            kubelet: Duration::ZERO,
            read: Duration::ZERO,
            waited: Duration::ZERO,
        }
    }

    /// Logs the call's stages, in microseconds.
    pub(super) fn log(&self, call: &'static str, answered: bool) {
        let us = |d: Duration| u64::try_from(d.as_micros()).unwrap_or(u64::MAX);
        tracing::debug!(
            call,
            answered,
            runs = self.runs,
            run_us = us(self.run),
            kubelet_us = us(self.kubelet),
            read_us = us(self.read),
            waited_us = us(self.waited),
            total_us = us(self.started.elapsed()),
            "kubelet call done"
        );
    }
}

/// Runs `f`, returning its output and how long it took.
pub(super) async fn timed<T>(f: impl Future<Output = T>) -> (T, Duration) {
    let t = Instant::now();
    let out = f.await;
    (out, t.elapsed())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn timed_measures_the_future() {
        let (out, took) = timed(async {
            tokio::time::sleep(Duration::from_millis(20)).await;
            7
        })
        .await;
        assert_eq!(out, 7);
        assert!(took >= Duration::from_millis(20), "{took:?}");
        let stages = Stages::start();
        assert_eq!((stages.runs, stages.run, stages.kubelet), (0, Duration::ZERO, Duration::ZERO));
        stages.log("Allocate", true);
    }
}
