//! Runs `gpushare-mangen` into a temporary directory and checks what the packages will install:
//! every page is roff in the right section and documents every long flag its binary accepts
//! (found by walking the binary's own clap definition), and the completions exist.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::path::Path;
use std::process::Command;

use clap::CommandFactory as _;

/// Every page: its path under the output directory, its name, its section and its command.
fn pages() -> Vec<(&'static str, &'static str, &'static str, clap::Command)> {
    vec![
        ("man8/gpushared.8", "gpushared", "8", gpushared::cli::Cli::command()),
        ("man8/gpushare-extender.8", "gpushare-extender", "8", gpushare_extender::cli::ExtenderCli::command()),
        ("man1/gpusharectl.1", "gpusharectl", "1", gpusharectl::Cli::command()),
        (
            "man1/kubectl-inspect-gpushare.1",
            "kubectl-inspect-gpushare",
            "1",
            gpushare_extender::cli::InspectCli::command(),
        ),
    ]
}

/// The long flags `cmd` and its visible subcommands accept, `--help` and `--version` included.
fn long_flags(cmd: &mut clap::Command) -> Vec<String> {
    cmd.build();
    let mut flags = Vec::new();
    collect_long_flags(cmd, &mut flags);
    flags.sort();
    flags.dedup();
    flags
}

fn collect_long_flags(cmd: &clap::Command, flags: &mut Vec<String>) {
    flags.extend(cmd.get_arguments().filter(|a| !a.is_hide_set()).filter_map(|a| a.get_long()).map(str::to_owned));
    for sub in cmd.get_subcommands().filter(|s| !s.is_hide_set() && s.get_name() != "help") {
        collect_long_flags(sub, flags);
    }
}

fn generate(out: &Path) -> String {
    let result = Command::new(env!("CARGO_BIN_EXE_gpushare-mangen")).arg(out).output().unwrap();
    assert!(result.status.success(), "gpushare-mangen failed: {}", String::from_utf8_lossy(&result.stderr));
    String::from_utf8(result.stdout).unwrap()
}

#[test]
fn every_page_is_roff_in_its_section_and_documents_every_long_flag() {
    let dir = tempfile::tempdir().unwrap();
    let listed = generate(dir.path());
    for (path, name, section, mut cmd) in pages() {
        let file = dir.path().join(path);
        assert!(listed.lines().any(|l| Path::new(l) == file), "{path} not listed in {listed}");
        let page = std::fs::read_to_string(&file).unwrap_or_else(|e| panic!("{path}: {e}"));
        let th = format!(".TH {name} {section} ");
        assert!(page.starts_with(&th), "{path} does not open with {th:?}: {:?}", page.lines().next());
        assert_eq!(page.matches(".TH ").count(), 1, "{path}: one title");
        assert!(page.contains(".SH NAME\n") && page.contains(".SH SYNOPSIS\n") && page.contains(".SH DESCRIPTION\n"));
        assert!(page.contains("\"gpushare manual\""), "{path}: the manual's name");
        assert!(page.contains(&format!("\"gpushare {}\"", env!("CARGO_PKG_VERSION"))), "{path}: the source");
        // Each flag has an entry of its own (a `.TP` tag naming it), not just a mention in prose.
        let lines: Vec<&str> = page.lines().collect();
        let tags: Vec<&str> = lines.windows(2).filter(|w| w[0] == ".TP").map(|w| w[1]).collect();
        let flags = long_flags(&mut cmd);
        assert!(flags.len() >= 3, "{path}: {flags:?}");
        for flag in flags {
            let roff = format!("\\fB\\-\\-{}\\fR", flag.replace('-', "\\-"));
            assert!(tags.iter().any(|t| t.contains(&roff)), "{path} does not document --{flag}");
        }
        // No text line is taken for a roff request by accident.
        assert!(page.lines().all(|l| !l.starts_with('\'')), "{path}");
    }
}

#[test]
fn the_daemon_pages_name_their_files_units_and_related_pages() {
    let dir = tempfile::tempdir().unwrap();
    generate(dir.path());
    let read = |path: &str| std::fs::read_to_string(dir.path().join(path)).unwrap();
    let daemon = read("man8/gpushared.8");
    for needle in [
        ".SH FILES",
        ".SH \"SEE ALSO\"",
        ".SH \"EXIT STATUS\"",
        "/etc/gpushare/gpushared.toml",
        "/var/lib/gpushare/ledger.db",
        "gpushared.service",
        ".BR gpusharectl (1)",
    ] {
        assert!(daemon.contains(needle), "gpushared(8) lacks {needle:?}");
    }
    let extender = read("man8/gpushare-extender.8");
    for needle in [
        ".SH FILES",
        ".SH \"SEE ALSO\"",
        ".SH COMMANDS",
        "/etc/gpushare/gpushare\\-extender.toml",
        "gpushare\\-extender.service",
        ".BR kubectl\\-inspect\\-gpushare (1)",
    ] {
        assert!(extender.contains(needle), "gpushare-extender(8) lacks {needle:?}");
    }
    let inspect = read("man1/kubectl-inspect-gpushare.1");
    assert!(inspect.contains("kubectl\\-inspect\\-gpushare \\- show the GPU memory"), "{inspect}");
    assert!(inspect.contains(".SH \"SEE ALSO\""));
}

#[test]
fn gpusharectl_page_and_completions_are_the_library_s() {
    let dir = tempfile::tempdir().unwrap();
    generate(dir.path());
    let read = |path: &str| std::fs::read(dir.path().join(path)).unwrap();
    // `gpusharectl generate man`'s page, with its title on the first line.
    let page = String::from_utf8(read("man1/gpusharectl.1")).unwrap();
    let library = String::from_utf8(gpusharectl::man_page().unwrap()).unwrap();
    let title = library.lines().find(|l| l.starts_with(".TH ")).unwrap();
    let rest: Vec<&str> = library.lines().filter(|l| *l != title).collect();
    assert_eq!(page, format!("{title}\n{}\n", rest.join("\n")));
    let shells = [
        ("completions/gpusharectl.bash", gpusharectl::Shell::Bash),
        ("completions/_gpusharectl", gpusharectl::Shell::Zsh),
        ("completions/gpusharectl.fish", gpusharectl::Shell::Fish),
    ];
    for (path, shell) in shells {
        let script = read(path);
        assert_eq!(script, gpusharectl::completions(shell), "{path}");
        let text = String::from_utf8(script).unwrap();
        assert!(text.contains("gpusharectl") && text.contains("uncordon"), "{path}: {text}");
    }
    assert!(String::from_utf8(read("completions/_gpusharectl")).unwrap().starts_with("#compdef gpusharectl"));
}

#[test]
fn a_missing_argument_is_a_usage_error() {
    let result = Command::new(env!("CARGO_BIN_EXE_gpushare-mangen")).output().unwrap();
    assert_eq!(result.status.code(), Some(2));
}
