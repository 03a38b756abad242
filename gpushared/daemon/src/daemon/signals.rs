//! SIGTERM and SIGINT, caught from the daemon's first moment: a stop that arrives while it
//! starts waits for it, and the daemon then stops as it would later (STOPPING=1, exit 0).

use futures::FutureExt as _;
use tokio::signal::unix::{Signal, SignalKind, signal};

/// SIGTERM and SIGINT, caught from the moment [`StopSignals::install`] returns: a signal that
/// arrives while the daemon starts waits here (instead of killing the process) until the daemon
/// can stop cleanly.
pub(super) struct StopSignals {
    signals: Option<(Signal, Signal)>,
    arrived: bool,
}

impl StopSignals {
    /// Installs the handlers. If that fails (it does not on Linux), the signals keep their
    /// default action, as before the handlers existed: the process ends at once.
    pub(super) fn install() -> Self {
        let signals = match (signal(SignalKind::terminate()), signal(SignalKind::interrupt())) {
            (Ok(term), Ok(int)) => Some((term, int)),
            (Err(e), _) | (_, Err(e)) => {
                tracing::warn!(error = %e, "cannot catch SIGTERM and SIGINT; they will end the daemon without STOPPING=1");
                None
            }
        };
        StopSignals { signals, arrived: false }
    }

    /// Resolves once SIGTERM or SIGINT has arrived, at once if one already has. Cancel-safe.
    pub(super) async fn arrived(&mut self) {
        if self.arrived {
            return;
        }
        let Some((term, int)) = &mut self.signals else { return std::future::pending().await };
        tokio::select! {
            _ = term.recv() => {}
            _ = int.recv() => {}
        }
        self.arrived = true;
    }

    /// Whether SIGTERM or SIGINT has arrived, without waiting.
    pub(super) fn has_arrived(&mut self) -> bool {
        self.arrived().now_or_never().is_some()
    }
}
