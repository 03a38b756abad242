//! gpusharectl's shapes, times, failures and command line, without a bus.

use std::sync::Arc;

use clap::{CommandFactory as _, Parser as _};
use gpushared::config::Bus;
use gpushared::dbus::{ActivityRecord, AllocationRecord, GpuRecord, HistoryRecord, OverBudgetRecord};
use zbus::fdo;

use super::*;

fn gpu(index: u32, total: u64, used: u64, reason: &str, cordoned: bool) -> GpuRecord {
    let health = if reason.is_empty() { "Healthy" } else { "Unhealthy" };
    GpuRecord {
        index,
        uuid: format!("GPU-{index:04}"),
        model: "NVIDIA A100-SXM4-80GB".to_owned(),
        total_mib: total,
        used_mib: used,
        health: health.to_owned(),
        reason: reason.to_owned(),
        cordoned,
    }
}

fn activity(index: u32, mode: &str, utilization_percent: i32, memory_in_use_mib: i64) -> ActivityRecord {
    ActivityRecord { index, mode: mode.to_owned(), utilization_percent, memory_in_use_mib }
}

/// A container over budget: namespace, pod, container, GPU, MiB in use, budget, since.
fn over(
    namespace: &str,
    pod: &str,
    container: &str,
    gpu: u32,
    in_use: u64,
    budget: u64,
    since: i64,
) -> OverBudgetRecord {
    OverBudgetRecord {
        namespace: namespace.to_owned(),
        pod: pod.to_owned(),
        pod_uid: format!("uid-{pod}"),
        container: container.to_owned(),
        gpu_index: gpu,
        in_use_mib: in_use,
        budget_mib: budget,
        since_ms: since,
    }
}

fn strings(cells: &[&str]) -> Vec<String> {
    cells.iter().map(|s| (*s).to_owned()).collect()
}

#[test]
fn table_columns_are_as_wide_as_their_widest_cell() {
    let out = render_table(&["A", "LONG HEADER", "C"], &[strings(&["xxxx", "y", "z"]), strings(&["1", "22", "333"])]);
    assert_eq!(out, "A      LONG HEADER   C\nxxxx   y             z\n1      22            333\n");
}

#[test]
fn table_has_no_trailing_spaces_and_keeps_rows_on_one_line() {
    let out = render_table(&["A", "B"], &[strings(&["x", ""]), strings(&["two\nlines"])]);
    assert_eq!(out, "A           B\nx\ntwo lines\n");
    assert!(out.lines().all(|l| !l.ends_with(' ')));
}

#[test]
fn table_counts_characters_not_bytes() {
    let out = render_table(&["N", "X"], &[strings(&["é", "1"]), strings(&["ab", "2"])]);
    assert_eq!(out, "N    X\né    1\nab   2\n");
}

#[test]
fn gpus_table_is_sorted_aligned_and_shows_reasons() {
    let activity: Vec<ActivityRecord> = vec![activity(1, "whole", 87, 40_960), activity(0, "shared", -1, -1)];
    let out = gpus_text(&[gpu(1, 81_920, 20_480, "Xid 79", true), gpu(0, 81_920, 0, "", false)], &activity);
    let lines: Vec<&str> = out.lines().collect();
    assert_eq!(lines.len(), 3);
    assert!(lines[0].starts_with("INDEX   UUID       MODEL"), "{out}");
    assert!(lines[1].starts_with("0       GPU-0000"), "{out}");
    assert!(lines[2].contains("Unhealthy (Xid 79)"), "{out}");
    assert!(lines[2].ends_with("yes"), "{out}");
    assert!(lines[2].contains("81920        20480       61440       whole    87        40960         "), "{out}");
    assert!(lines[1].contains("81920        0           81920       shared   -         -             "), "{out}");
    // Every column starts at the same offset on every line.
    let col = lines[0].find("HEALTH").unwrap();
    assert_eq!(lines[1].find("Healthy"), Some(col));
    assert_eq!(lines[2].find("Unhealthy"), Some(col));
}

#[test]
fn gpus_json_has_camel_case_keys_and_null_reason_when_healthy() {
    let v = gpus_json(&[gpu(1, 100, 150, "Xid 79", true), gpu(0, 100, 40, "", false)], &[activity(1, "mps", 5, 90)]);
    assert_eq!(
        v[0],
        json!({"index": 0, "uuid": "GPU-0000", "model": "NVIDIA A100-SXM4-80GB", "totalMiB": 100, "usedMiB": 40,
               "freeMiB": 60, "health": "Healthy", "healthReason": null, "cordoned": false,
               "mode": "shared", "utilPercent": null, "inUseMiB": null})
    );
    assert_eq!(v[1]["healthReason"], "Xid 79");
    assert_eq!((&v[1]["mode"], &v[1]["utilPercent"], &v[1]["inUseMiB"]), (&json!("mps"), &json!(5), &json!(90)));
    assert_eq!(v[1]["freeMiB"], 0, "used over total saturates");
}

#[test]
fn status_counts_gpus() {
    let s = Status {
        node: "n1".into(),
        version: "0.1.0".into(),
        unit: "MiB".into(),
        gpus: vec![gpu(0, 100, 10, "", true), gpu(1, 100, 20, "Xid 79", false)],
        allocations: 3,
        over_budget: 1,
    };
    let text = status_text(&s);
    assert!(text.ends_with("over budget:  1 containers\n"), "{text}");
    assert!(text.contains("gpus:         2 (1 healthy, 1 unhealthy, 1 cordoned)\n"), "{text}");
    assert!(text.contains("memory:       30 MiB used of 200 MiB (170 MiB free)\n"), "{text}");
    assert!(text.starts_with("node:         n1\n"), "{text}");
    let v = status_json(&s);
    assert_eq!(v["gpus"], json!({"total": 2, "healthy": 1, "unhealthy": 1, "cordoned": 1}));
    assert_eq!(v["allocations"], 3);
    assert_eq!(v["overBudget"], 1);
    assert_eq!(v["freeMiB"], 170);
}

#[test]
fn over_budget_table_and_json() {
    assert_eq!(over_budget_text(&[]), "no container is over its budget\n");
    let rows: Vec<OverBudgetRecord> = vec![
        over("ml", "train", "main", 1, 5200, 4096, 1_763_892_000_000),
        over("default", "rogue", "", 0, 800, 0, 1_763_892_060_000),
    ];
    assert_eq!(
        over_budget_text(&rows),
        "NAMESPACE   POD     CONTAINER   GPU   IN-USE(MiB)   BUDGET(MiB)   SINCE\n\
         default     rogue   -           0     800           0             2025-11-23T10:01:00Z\n\
         ml          train   main        1     5200          4096          2025-11-23T10:00:00Z\n"
    );
    let v = over_budget_json(&rows);
    assert_eq!(v[0]["container"], Value::Null);
    assert_eq!(v[1]["container"], "main");
    assert_eq!(v[1]["inUseMiB"], 5200);
    assert_eq!(v[1]["sinceMs"], 1_763_892_000_000_i64);
}

#[test]
fn allocations_table_and_json() {
    let row = AllocationRecord {
        namespace: "default".into(),
        pod: "infer-1".into(),
        pod_uid: "uid-1".into(),
        container: "main".into(),
        role: "app".into(),
        gpu_uuid: "GPU-0001".into(),
        gpu_index: 1,
        mib: 4096,
        allocated_at_ms: 1_763_892_000_000,
    };
    let out = allocations_text(std::slice::from_ref(&row), None);
    assert_eq!(
        out,
        "NAMESPACE   POD       CONTAINER   ROLE   GPU   MIB    SINCE\n\
         default     infer-1   main        app    1     4096   2025-11-23T10:00:00Z\n"
    );
    let v = allocations_json(&[row]);
    assert_eq!(v[0]["podUid"], "uid-1");
    assert_eq!(v[0]["gpuIndex"], 1);
    assert_eq!(v[0]["allocatedAt"], "2025-11-23T10:00:00Z");
    assert_eq!(v[0]["allocatedAtMs"], 1_763_892_000_000_i64);
    assert_eq!(allocations_text(&[], Some("default/x")), "no live allocations of default/x\n");
}

#[test]
fn history_table_and_json() {
    let rows: Vec<HistoryRecord> = vec![HistoryRecord { at_ms: 0, kind: "cordon".into(), detail: "GPU 1".into() }];
    assert_eq!(
        history_text(&rows, 0),
        "TIME                   KIND     DETAIL\n1970-01-01T00:00:00Z   cordon   GPU 1\n"
    );
    assert_eq!(history_text(&[], 0), "nothing since 1970-01-01T00:00:00Z\n");
    assert_eq!(
        history_json(&rows)[0],
        json!({"time": "1970-01-01T00:00:00Z", "timeMs": 0, "kind": "cordon", "detail": "GPU 1"})
    );
}

#[test]
fn cordon_messages() {
    assert_eq!(cordon_output("1", true, true, false), "GPU 1 cordoned\n");
    assert_eq!(cordon_output("1", true, false, false), "GPU 1 was already cordoned\n");
    assert_eq!(cordon_output("1", false, true, false), "GPU 1 uncordoned\n");
    assert_eq!(cordon_output("1", false, false, false), "GPU 1 was not cordoned\n");
    let v: Value = serde_json::from_str(&cordon_output("GPU-1", true, false, true)).unwrap();
    assert_eq!(v, json!({"gpu": "GPU-1", "cordoned": true, "changed": false}));
}

#[test]
fn formats_rfc3339_utc() {
    assert_eq!(format_ms(0), "1970-01-01T00:00:00Z");
    assert_eq!(format_ms(1_763_892_000_000), "2025-11-23T10:00:00Z");
    assert_eq!(format_ms(1_763_892_000_999), "2025-11-23T10:00:00Z");
    assert_eq!(format_ms(951_782_400_000), "2000-02-29T00:00:00Z");
    assert_eq!(format_ms(4_107_542_399_000), "2100-02-28T23:59:59Z");
    assert_eq!(format_ms(-1), "1969-12-31T23:59:59Z");
    // No panic at the ends of the range.
    assert!(!format_ms(i64::MAX).is_empty());
    assert!(!format_ms(i64::MIN).is_empty());
}

const NOW: i64 = 1_763_892_000_000;

#[test]
fn parses_rfc3339() {
    assert_eq!(parse_since("2025-11-23T10:00:00Z", NOW), Ok(NOW));
    assert_eq!(parse_since(" 1970-01-01T00:00:00Z ", NOW), Ok(0));
    assert_eq!(parse_since("2025-11-23t10:00:00.5z", NOW), Ok(NOW + 500));
    assert_eq!(parse_since("2025-11-23T10:00:00.123456Z", NOW), Ok(NOW + 123));
    assert_eq!(parse_since("2025-11-23T11:30:00+01:30", NOW), Ok(NOW));
    assert_eq!(parse_since("2025-11-23T08:00:00-02:00", NOW), Ok(NOW));
    assert_eq!(parse_since("2024-02-29T00:00:00Z", NOW), Ok(1_709_164_800_000));
}

#[test]
fn parses_unix_ms_and_durations() {
    assert_eq!(parse_since("1763892000000", 0), Ok(NOW));
    assert_eq!(parse_since("0", NOW), Ok(0));
    assert_eq!(parse_since("30s", NOW), Ok(NOW - 30_000));
    assert_eq!(parse_since("10m", NOW), Ok(NOW - 600_000));
    assert_eq!(parse_since("2h", NOW), Ok(NOW - 7_200_000));
    assert_eq!(parse_since("1d", NOW), Ok(NOW - 86_400_000));
    assert_eq!(parse_since("0s", NOW), Ok(NOW));
}

#[test]
fn refuses_what_is_not_a_time() {
    for bad in [
        "",
        "   ",
        "yesterday",
        "10x",
        "-5m",
        "m",
        "1.5h",
        "10 m",
        "99999999999999999999",
        "99999999999999999999d",
        "2025-13-01T00:00:00Z",
        "2025-02-29T00:00:00Z",
        "2025-11-31T00:00:00Z",
        "2025-11-23T24:00:00Z",
        "2025-11-23T10:60:00Z",
        "2025-11-23T10:00:00",
        "2025-11-23T10:00:00.Z",
        "2025-11-23T10:00:00+1:00",
        "2025-11-23",
        "2025-11-23T10:00:00Zjunk",
        "2025-11-23T10:00:00\u{e9}",
        "2025-\u{e9}1-23T10:00:00Z",
    ] {
        let e = parse_since(bad, NOW).expect_err(bad);
        assert!(!e.is_empty());
    }
    assert!(parse_since("yesterday", NOW).unwrap_err().contains("RFC 3339"));
    assert!(parse_since("99999999999999999999d", NOW).unwrap_err().contains("too long ago"));
    assert!(parse_since("2025-13-01T00:00:00Z", NOW).unwrap_err().contains("no such date"));
}

fn fdo_error(e: fdo::Error) -> zbus::Error {
    zbus::Error::from(e)
}

#[test]
fn classifies_a_missing_daemon() {
    for e in [
        fdo_error(fdo::Error::ServiceUnknown("The name is not activatable".into())),
        fdo_error(fdo::Error::NameHasNoOwner("no owner".into())),
    ] {
        let f = classify(&e);
        assert_eq!(f, Failure::NotRunning);
        assert_eq!(f.exit_code(), 69);
        assert_eq!(
            f.message(&Bus::System, &Request::Status),
            "gpushared is not running (no io.gpushare.GpuShare1 on the system bus); start it with: systemctl start gpushared"
        );
        assert!(
            f.message(&Bus::Address("unix:path=/tmp/x/bus".into()), &Request::Gpus).contains("unix:path=/tmp/x/bus")
        );
    }
}

#[test]
fn classifies_an_unreachable_bus() {
    let address: zbus::Address = "unix:path=/nonexistent/bus".parse().unwrap();
    let e = zbus::Error::Connection(Arc::new(std::io::ErrorKind::NotFound.into()), Box::new(address));
    let f = classify(&e);
    assert!(matches!(f, Failure::NoBus(_)), "{f:?}");
    assert_eq!(f.exit_code(), 69);
    let e = zbus::Error::InputOutput(Arc::new(std::io::ErrorKind::TimedOut.into()));
    assert!(matches!(classify(&e), Failure::NoAnswer(_)));
    assert_eq!(classify(&fdo_error(fdo::Error::NoReply("late".into()))).exit_code(), 69);
    assert_eq!(classify(&fdo_error(fdo::Error::Disconnected("gone".into()))).exit_code(), 69);
}

#[test]
fn classifies_access_denied() {
    let e = fdo_error(fdo::Error::AccessDenied("Rejected send message".into()));
    let f = classify(&e);
    assert_eq!(f, Failure::PermissionDenied("Rejected send message".into()));
    assert_eq!(f.exit_code(), 77);
    assert_eq!(
        f.message(&Bus::System, &Request::Cordon { gpu: "1".into() }),
        "permission denied: cordon needs root (the D-Bus policy and gpushared itself let only root change gpushared)"
    );
    assert!(f.message(&Bus::System, &Request::Status).contains("status"));
    let e = zbus::Error::InputOutput(Arc::new(std::io::ErrorKind::PermissionDenied.into()));
    assert_eq!(classify(&e).exit_code(), 77);
}

#[test]
fn classifies_other_errors_as_refusals() {
    let e = fdo_error(fdo::Error::InvalidArgs("\"7\" is not a GPU on this node".into()));
    let f = classify(&e);
    assert_eq!(f, Failure::Refused("\"7\" is not a GPU on this node".into()));
    assert_eq!(f.exit_code(), 1);
    assert_eq!(f.message(&Bus::System, &Request::Cordon { gpu: "7".into() }), "\"7\" is not a GPU on this node");
    assert_eq!(classify(&fdo_error(fdo::Error::Failed("ledger".into()))).exit_code(), 1);
    let f = classify(&fdo_error(fdo::Error::UnknownMethod("no Explain".into())));
    assert_eq!(f.exit_code(), 1);
    assert!(f.message(&Bus::System, &Request::Status).contains("older"));
    assert_eq!(classify(&zbus::Error::InvalidReply).exit_code(), 1);
    // An fdo::Error wrapping a zbus::Error is classified by what it wraps.
    let wrapped = zbus::Error::FDO(Box::new(fdo::Error::ZBus(zbus::Error::FDO(Box::new(fdo::Error::ServiceUnknown(
        String::new(),
    ))))));
    assert_eq!(classify(&wrapped), Failure::NotRunning);
}

#[test]
fn cli_parses_globals_anywhere() {
    let cli = Cli::try_parse_from(["gpusharectl", "gpus", "--json", "--address", "unix:path=/tmp/x/bus"]).unwrap();
    assert!(cli.json);
    assert_eq!(cli.bus(), Bus::Address("unix:path=/tmp/x/bus".into()));
    assert_eq!(cli.command, Command::Request(Request::Gpus));
    let cli = Cli::try_parse_from(["gpusharectl", "--json", "history", "--since", "1763892000000"]).unwrap();
    assert_eq!(cli.command, Command::Request(Request::History { since: Some(NOW) }));
    assert_eq!(cli.bus(), Bus::System);
    let cli = Cli::try_parse_from(["gpusharectl", "allocations", "--pod", "default/infer-1"]).unwrap();
    assert_eq!(cli.command, Command::Request(Request::Allocations { pod: Some("default/infer-1".into()) }));
}

#[test]
fn cli_usage_errors() {
    for args in [
        &["gpusharectl"][..],
        &["gpusharectl", "history", "--since", "soon"],
        &["gpusharectl", "--address", "nonsense", "status"],
        &["gpusharectl", "cordon"],
        &["gpusharectl", "generate", "completions", "powershell"],
    ] {
        let e = Cli::try_parse_from(args).unwrap_err();
        assert_eq!(e.exit_code(), i32::from(EXIT_USAGE), "{args:?}");
    }
}

#[test]
fn cli_definition_is_consistent() {
    Cli::command().debug_assert();
}

const SUBCOMMANDS: [&str; 7] = ["status", "gpus", "allocations", "history", "explain", "cordon", "uncordon"];

#[test]
fn man_page_describes_every_subcommand_and_the_exit_codes() {
    let page = String::from_utf8(man_page().unwrap()).unwrap();
    assert!(page.contains(".TH gpusharectl 1"), "roff");
    for sub in SUBCOMMANDS {
        assert!(page.contains(&format!("\\fBgpusharectl {sub}\\fR")), "{sub} missing from the man page");
    }
    assert!(page.contains(r"\fBgpusharectl allocations\fR [\fB\-\-pod\fR \fINS/NAME\fR]"), "{page}");
    assert!(page.contains(r"\fBgpusharectl explain\fR \fINS/NAME\fR"), "{page}");
    assert!(page.contains(r"\fBgpusharectl cordon\fR \fIGPU\fR"), "{page}");
    assert!(page.contains(".SH \"EXIT STATUS\"") && page.contains(r"\fB69\fR (EX_UNAVAILABLE)"));
    assert!(page.contains(r"\fB77\fR (EX_NOPERM)"));
    assert!(!page.contains("generate"), "the generate subcommand is hidden");
    assert!(!page.contains("gpusharectl\\-status(1)"), "no references to per-command pages");
    // No text line is read as a roff request.
    assert!(page.lines().all(|l| !l.starts_with('\'')));
}

#[test]
fn roff_text_escapes() {
    assert_eq!(roff_text(".start\n'quote\na-b \\ c"), "\\&.start\n\\&'quote\na\\-b \\e c\n");
}

#[test]
fn completions_are_generated() {
    let bash = String::from_utf8(completions(Shell::Bash)).unwrap();
    assert!(!bash.is_empty());
    assert!(bash.contains("gpusharectl") && bash.contains("uncordon"));
    assert!(!completions(Shell::Zsh).is_empty());
    assert!(!completions(Shell::Fish).is_empty());
}
