//! The one line systemd shows for gpushared (`systemctl status`, `STATUS=`): the GPUs, the
//! allocations and whether the kubelet accepted the registration, sent after every change.

use std::sync::Arc;
use std::time::Duration;

use gpushare_sdnotify::Notifier;

use crate::allocation::allocator::Allocator;

/// What the systemd status line says.
#[derive(Clone, Debug)]
pub struct Status {
    /// The allocation service, whose summary the line gives.
    pub alloc: Arc<Allocator>,
    /// Whether the kubelet accepted the registration.
    pub registered: Arc<std::sync::atomic::AtomicBool>,
    /// The kubelet's registration socket, named while waiting for it.
    pub kubelet: std::path::PathBuf,
    /// Wakes [`report_status`] when the registration changes.
    pub wake: Arc<tokio::sync::Notify>,
}

impl Status {
    /// The line.
    #[must_use]
    pub fn line(&self) -> String {
        let s = self.alloc.summary();
        let gpus = if s.healthy == s.gpus {
            format!("{} GPU{}", s.gpus, if s.gpus == 1 { "" } else { "s" })
        } else {
            format!("{} GPUs ({} unhealthy)", s.gpus, s.gpus - s.healthy)
        };
        let allocations = format!("{} allocation{}", s.allocations, if s.allocations == 1 { "" } else { "s" });
        if self.registered.load(std::sync::atomic::Ordering::SeqCst) {
            format!("serving {gpus}, {allocations}")
        } else {
            format!("waiting for the kubelet at {}; {gpus}, {allocations}", self.kubelet.display())
        }
    }

    /// Wakes [`report_status`].
    pub fn changed(&self) {
        self.wake.notify_one();
    }
}

/// Sends the status line to systemd after every change, at most every 200 ms.
pub async fn report_status(notifier: Notifier, status: Status) {
    let mut changes = status.alloc.subscribe();
    let mut last = String::new();
    loop {
        let line = status.line();
        if line != last {
            notifier.status(&line);
            last = line;
        }
        tokio::select! {
            changed = changes.changed() => {
                if changed.is_err() {
                    return;
                }
            }
            () = status.wake.notified() => {}
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
        changes.borrow_and_update();
    }
}
