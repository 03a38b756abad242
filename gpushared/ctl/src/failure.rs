//! Why a request to gpushared failed, and the exit status and one-line message that say so.

use gpushared::config::Bus;
use gpushared::dbus::BUS_NAME;
use zbus::DBusError as _;
use zbus::fdo;

use crate::cli::Request;

/// Exit status: the daemon refused the request (a D-Bus error reply such as an unknown GPU).
pub const EXIT_REFUSED: u8 = 1;
/// Exit status: a usage error (clap's own).
pub const EXIT_USAGE: u8 = 2;
/// Exit status `EX_UNAVAILABLE`: gpushared cannot be reached (not running, API off, no bus).
pub const EXIT_UNAVAILABLE: u8 = 69;
/// Exit status `EX_NOPERM`: the bus's policy refused the call.
pub const EXIT_NOPERM: u8 = 77;

/// Why a request to gpushared failed, as the exit status tells it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Failure {
    /// The bus cannot be reached: no socket, a refused connection, a failed handshake, a
    /// connection lost (exit 69).
    NoBus(String),
    /// The bus is there but nobody owns `io.gpushare.GpuShare1`: gpushared is not running, or
    /// runs with `[dbus] enabled = false` or on another bus (exit 69).
    NotRunning,
    /// gpushared took the call but did not answer in time (exit 69).
    NoAnswer(String),
    /// The bus's policy refused the call (exit 77).
    PermissionDenied(String),
    /// gpushared answered with an error: an unknown GPU, a malformed pod name, a ledger it
    /// cannot read; or an answer gpusharectl does not understand (exit 1).
    Refused(String),
}

/// What a D-Bus failure means for the user, the exit status included.
#[must_use]
pub fn classify(e: &zbus::Error) -> Failure {
    match e {
        zbus::Error::FDO(f) => classify_fdo(f),
        zbus::Error::Connection(io, _) | zbus::Error::InputOutput(io) => match io.kind() {
            std::io::ErrorKind::PermissionDenied => Failure::PermissionDenied(e.to_string()),
            std::io::ErrorKind::TimedOut => Failure::NoAnswer(e.to_string()),
            _ => Failure::NoBus(e.to_string()),
        },
        zbus::Error::Handshake(_) | zbus::Error::Address(_) | zbus::Error::Unsupported => Failure::NoBus(e.to_string()),
        zbus::Error::MethodError(name, detail, _) => {
            Failure::Refused(detail.as_ref().map_or_else(|| name.to_string(), |d| format!("{d} ({name})")))
        }
        zbus::Error::DBus(d) => Failure::Refused(d.description().map_or_else(|| d.to_string(), str::to_owned)),
        other => Failure::Refused(format!("unexpected answer from gpushared: {other}")),
    }
}

fn classify_fdo(f: &fdo::Error) -> Failure {
    let detail = || f.description().map_or_else(|| f.to_string(), str::to_owned);
    match f {
        fdo::Error::ZBus(e) => classify(e),
        fdo::Error::ServiceUnknown(_) | fdo::Error::NameHasNoOwner(_) => Failure::NotRunning,
        fdo::Error::AccessDenied(_) | fdo::Error::AuthFailed(_) => Failure::PermissionDenied(detail()),
        fdo::Error::NoReply(_) | fdo::Error::Timeout(_) | fdo::Error::TimedOut(_) => Failure::NoAnswer(detail()),
        fdo::Error::NoServer(_)
        | fdo::Error::Disconnected(_)
        | fdo::Error::IOError(_)
        | fdo::Error::BadAddress(_)
        | fdo::Error::NoNetwork(_) => Failure::NoBus(detail()),
        fdo::Error::UnknownMethod(_)
        | fdo::Error::UnknownInterface(_)
        | fdo::Error::UnknownObject(_)
        | fdo::Error::UnknownProperty(_) => Failure::Refused(format!(
            "{} (is the owner of {BUS_NAME} a gpushared older than this gpusharectl?)",
            detail()
        )),
        _ => Failure::Refused(detail()),
    }
}

impl Failure {
    /// The exit status: 1, 69 or 77.
    #[must_use]
    pub fn exit_code(&self) -> u8 {
        match self {
            Failure::NoBus(_) | Failure::NotRunning | Failure::NoAnswer(_) => EXIT_UNAVAILABLE,
            Failure::PermissionDenied(_) => EXIT_NOPERM,
            Failure::Refused(_) => EXIT_REFUSED,
        }
    }

    /// The one line to print after `gpusharectl: `, for `request` on `bus`.
    #[must_use]
    pub fn message(&self, bus: &Bus, request: &Request) -> String {
        match (self, bus) {
            (Failure::NotRunning, Bus::System) => format!(
                "gpushared is not running (no {BUS_NAME} on the system bus); start it with: systemctl start gpushared"
            ),
            (Failure::NotRunning, Bus::Address(a)) => format!(
                "gpushared is not running (no {BUS_NAME} on the bus at {a}); start it with [dbus] address = \"{a}\" in its configuration"
            ),
            (Failure::NoBus(d), Bus::System) => {
                format!("cannot reach gpushared: the system bus is not available ({d}); check: systemctl status dbus")
            }
            (Failure::NoBus(d), Bus::Address(_)) => format!("cannot reach gpushared: {d}"),
            (Failure::NoAnswer(d), _) => {
                format!("gpushared did not answer {} in time ({d}); check: journalctl -u gpushared", request.name())
            }
            (Failure::PermissionDenied(_), _) if request.changes() => format!(
                "permission denied: {} needs root (the D-Bus policy and gpushared itself let only root change gpushared)",
                request.name()
            ),
            (Failure::PermissionDenied(d), _) => format!("permission denied: the bus refused {} ({d})", request.name()),
            (Failure::Refused(m), _) => m.clone(),
        }
    }
}
