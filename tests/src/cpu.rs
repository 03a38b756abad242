//! CPU time a process and its descendants have used, read from `/proc`: where a burst's time
//! goes on a box whose components share a few cores (the side-by-side bench's CPU per pod).

use std::collections::HashMap;
use std::sync::OnceLock;
use std::time::Duration;

/// User plus system CPU time of process `pid` and every process below it, as they stand now
/// (those that have exited are not counted). Zero if `pid` is gone.
#[must_use]
pub fn tree(pid: u32) -> Duration {
    let mut parent: HashMap<u32, u32> = HashMap::new();
    let mut ticks: HashMap<u32, u64> = HashMap::new();
    for entry in std::fs::read_dir("/proc").into_iter().flatten().flatten() {
        let Some(p) = entry.file_name().to_str().and_then(|n| n.parse::<u32>().ok()) else { continue };
        let Ok(stat) = std::fs::read_to_string(entry.path().join("stat")) else { continue };
        if let Some((ppid, t)) = parse_stat(&stat) {
            parent.insert(p, ppid);
            ticks.insert(p, t);
        }
    }
    let below = |mut p: u32| {
        // A cycle cannot happen in /proc, but a bounded walk costs nothing.
        for _ in 0..64 {
            if p == pid {
                return true;
            }
            match parent.get(&p) {
                Some(&up) if up != 0 => p = up,
                _ => return false,
            }
        }
        false
    };
    let total: u64 = ticks.iter().filter(|(p, _)| below(**p)).map(|(_, t)| *t).sum();
    Duration::from_millis(total.saturating_mul(1000) / clock_ticks())
}

/// User plus system CPU time of process `pid` alone (its threads, not its children). Zero if
/// it is gone.
#[must_use]
pub fn own(pid: u32) -> Duration {
    let ticks =
        std::fs::read_to_string(format!("/proc/{pid}/stat")).ok().and_then(|s| parse_stat(&s)).map_or(0, |(_, t)| t);
    Duration::from_millis(ticks.saturating_mul(1000) / clock_ticks())
}

/// The CPUs process `pid` may run on (`Cpus_allowed_list` in its `/proc` status, a `taskset`
/// list such as `0-1`); `None` if it is gone.
#[must_use]
pub fn allowed(pid: u32) -> Option<String> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    status.lines().find_map(|l| l.strip_prefix("Cpus_allowed_list:")).map(|l| l.trim().to_owned())
}

/// Restricts process `pid` and every thread it has to the CPUs `cpus` (a `taskset` list such
/// as `1` or `0-1`); threads it starts later inherit the restriction. The side-by-side bench
/// uses it to keep a node's components off the control plane's CPU.
///
/// # Errors
/// If `taskset` (util-linux) is missing or refuses.
pub fn pin(pid: u32, cpus: &str) -> Result<(), String> {
    let out = std::process::Command::new("taskset")
        .args(["--all-tasks", "--cpu-list", "--pid", cpus, &pid.to_string()])
        .output()
        .map_err(|e| format!("running taskset (util-linux) to pin process {pid}: {e}"))?;
    if out.status.success() {
        Ok(())
    } else {
        Err(format!(
            "taskset could not pin process {pid} to CPUs {cpus}: {}",
            String::from_utf8_lossy(&out.stderr).trim()
        ))
    }
}

/// The parent and the user plus system ticks from a `/proc/<pid>/stat` line. The command name
/// (in parentheses) may hold spaces and parentheses; the fields follow its last `)`.
fn parse_stat(stat: &str) -> Option<(u32, u64)> {
    let rest = &stat[stat.rfind(')')? + 1..];
    let fields: Vec<&str> = rest.split_whitespace().collect();
    // After the name: state(0) ppid(1) ... utime(11) stime(12).
    let ppid = fields.get(1)?.parse().ok()?;
    let utime: u64 = fields.get(11)?.parse().ok()?;
    let stime: u64 = fields.get(12)?.parse().ok()?;
    Some((ppid, utime + stime))
}

/// The kernel's clock ticks per second (`getconf CLK_TCK`; 100 where it cannot be asked).
fn clock_ticks() -> u64 {
    static TICKS: OnceLock<u64> = OnceLock::new();
    *TICKS.get_or_init(|| {
        std::process::Command::new("getconf")
            .arg("CLK_TCK")
            .output()
            .ok()
            .and_then(|o| String::from_utf8(o.stdout).ok())
            .and_then(|s| s.trim().parse().ok())
            .filter(|t| *t > 0)
            .unwrap_or(100)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_stat_line_with_a_strange_name_is_read_after_its_last_parenthesis() {
        let line = "4242 (kube (a) b) S 17 4242 4242 0 -1 4194560 100 0 0 0 250 31 0 0 20 0 12 0 99 0 0";
        assert_eq!(parse_stat(line), Some((17, 281)));
        assert_eq!(parse_stat("garbage"), None);
    }

    #[test]
    fn this_process_has_used_some_cpu_and_a_missing_one_none() {
        let mut x = 0u64;
        for i in 0..20_000_000u64 {
            x = x.wrapping_mul(31).wrapping_add(i);
        }
        assert!(x != 1);
        // Its own time first: the tree read after it includes that and whatever came since.
        let alone = own(std::process::id());
        assert!(tree(std::process::id()) >= alone);
        assert!(alone > Duration::ZERO);
        assert_eq!(tree(u32::MAX), Duration::ZERO);
        assert_eq!(own(u32::MAX), Duration::ZERO);
    }

    #[test]
    fn a_pinned_process_runs_only_on_its_cpus_and_a_missing_one_is_an_error() {
        let mut child = std::process::Command::new("sleep").arg("30").spawn().unwrap();
        let first = allowed(child.id()).unwrap().split([',', '-']).next().unwrap().to_owned();
        let pinned = pin(child.id(), &first);
        let now = allowed(child.id()).unwrap();
        let _ = child.kill();
        let _ = child.wait();
        pinned.unwrap();
        assert_eq!(now, first);
        let e = pin(u32::MAX, &first).unwrap_err();
        assert!(e.contains("could not pin process"), "{e}");
        assert_eq!(allowed(u32::MAX), None);
    }
}
