//! The `gpusharectl` binary as an operator runs it, without gpushared: its version, its usage
//! errors, its completions, and the exit status and one line it gives when the bus cannot be
//! reached. (The D-Bus suite, `gpushared/daemon/tests/dbus.rs`, runs it against a real daemon.)
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::process::{Command, Output};

fn gpusharectl(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_gpusharectl")).args(args).output().unwrap()
}

fn text(out: &Output) -> String {
    format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr))
}

#[test]
fn it_names_its_version() {
    let out = gpusharectl(&["--version"]);
    assert!(out.status.success(), "{}", text(&out));
    assert_eq!(text(&out).trim(), format!("gpusharectl {}", env!("CARGO_PKG_VERSION")));
}

#[test]
fn a_usage_error_exits_2_and_says_what_is_accepted() {
    let out = gpusharectl(&["no-such-command"]);
    assert_eq!(out.status.code(), Some(2), "{}", text(&out));
    assert!(text(&out).contains("no-such-command"), "{}", text(&out));
}

#[test]
fn completions_are_generated_without_a_daemon() {
    let out = gpusharectl(&["generate", "completions", "bash"]);
    assert!(out.status.success(), "{}", text(&out));
    assert!(text(&out).contains("gpusharectl") && text(&out).contains("uncordon"), "{}", text(&out));
}

#[test]
fn an_unreachable_bus_exits_69_with_one_line() {
    let dir = tempfile_dir();
    let address = format!("unix:path={}/no-bus-here", dir.display());
    let out = gpusharectl(&["--address", &address, "status"]);
    assert_eq!(out.status.code(), Some(69), "{}", text(&out));
    let said = text(&out);
    assert!(said.starts_with("gpusharectl: cannot reach gpushared"), "{said}");
    assert_eq!(said.trim_end().lines().count(), 1, "{said}");
    let _ = std::fs::remove_dir_all(dir);
}

/// A fresh directory with no bus socket in it.
fn tempfile_dir() -> std::path::PathBuf {
    let dir = std::env::temp_dir().join(format!("gpusharectl-cli-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    dir
}
