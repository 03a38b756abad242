//! The files `gpushare-mangen` writes, rendered in memory: the four man pages and gpusharectl's
//! shell completions.
//!
//! Each page is built from its binary's clap definition (title, name, synopsis, options and
//! version through `clap_mangen`'s section renderers), so a flag added, renamed or dropped
//! changes the page with it. The prose the definitions cannot carry (what the daemon does, its
//! files, its unit, exit statuses, related pages) is roff text here.

use std::io;

use clap::CommandFactory as _;
use gpushare_extender::cli::{ExtenderCli, InspectCli};
use gpusharectl as ctl;
use gpushared::cli::Cli as GpusharedCli;

/// One file to write, by its path under the output directory.
#[derive(Debug)]
pub(crate) struct File {
    /// The path under the output directory, such as `man8/gpushared.8`.
    pub(crate) path: &'static str,
    /// The contents: roff, or a completion script.
    pub(crate) contents: Vec<u8>,
}

/// Every file, in the order they are written.
///
/// # Errors
///
/// Never in practice: rendering writes to memory.
pub(crate) fn all() -> io::Result<Vec<File>> {
    Ok(vec![
        File { path: "man8/gpushared.8", contents: title_first(&gpushared_page()?) },
        File { path: "man8/gpushare-extender.8", contents: title_first(&extender_page()?) },
        File { path: "man1/gpusharectl.1", contents: title_first(&ctl::man_page()?) },
        File { path: "man1/kubectl-inspect-gpushare.1", contents: title_first(&inspect_page()?) },
        File { path: "completions/gpusharectl.bash", contents: ctl::completions(ctl::Shell::Bash) },
        File { path: "completions/_gpusharectl", contents: ctl::completions(ctl::Shell::Zsh) },
        File { path: "completions/gpusharectl.fish", contents: ctl::completions(ctl::Shell::Fish) },
    ])
}

/// `page` with its `.TH` line first. `clap_mangen` writes the definition of its apostrophe
/// string (`.ie \n(.g .ds Aq \(aq`, `.el .ds Aq '`) before every section, the title included;
/// man-pages(7) wants `.TH` as a page's first request, and so do tools that read the title from
/// the first line. The definitions stay, after it: the title uses no apostrophe.
fn title_first(page: &[u8]) -> Vec<u8> {
    let text = String::from_utf8_lossy(page);
    let lines: Vec<&str> = text.split_inclusive('\n').collect();
    match lines.iter().position(|l| l.starts_with(".TH ")) {
        Some(i) => {
            let mut out = lines[i].to_owned();
            out.extend(lines.iter().enumerate().filter(|&(j, _)| j != i).map(|(_, l)| *l));
            out.into_bytes()
        }
        None => page.to_vec(),
    }
}

/// Where the documentation lives online (the systemd units' `Documentation=` say the same).
const DOCS: &str = concat!(env!("CARGO_PKG_REPOSITORY"), "/blob/main/docs");

/// A page for `cmd` in `section`, with the common `.TH` fields; `name` is the text of its NAME
/// line (the binaries' own `about` is their package's description, written for crates.io).
fn man(cmd: clap::Command, section: &str, name: &'static str) -> clap_mangen::Man {
    let version = cmd.get_version().unwrap_or(env!("CARGO_PKG_VERSION")).to_owned();
    clap_mangen::Man::new(cmd.about(name))
        .section(section)
        .source(format!("gpushare {version}"))
        .manual("gpushare manual")
}

/// Renders `page`'s title, NAME, SYNOPSIS, then `description` (roff, under its own `.SH
/// DESCRIPTION`), then OPTIONS.
fn head(page: &clap_mangen::Man, description: &str) -> io::Result<Vec<u8>> {
    let mut out = Vec::new();
    page.render_title(&mut out)?;
    page.render_name_section(&mut out)?;
    page.render_synopsis_section(&mut out)?;
    out.extend_from_slice(b".SH DESCRIPTION\n");
    out.extend_from_slice(description.as_bytes());
    page.render_options_section(&mut out)?;
    Ok(out)
}

/// Renders `tail` (roff: the sections after OPTIONS), then VERSION and SEE ALSO.
fn finish(mut out: Vec<u8>, page: &clap_mangen::Man, tail: &str, see_also: &str) -> io::Result<Vec<u8>> {
    out.extend_from_slice(tail.as_bytes());
    page.render_version_section(&mut out)?;
    // Left-adjusted: a long address on a justified line leaves wide gaps before it.
    out.extend_from_slice(b".SH \"SEE ALSO\"\n.ad l\n");
    out.extend_from_slice(see_also.as_bytes());
    Ok(out)
}

/// `clap_mangen` output without its section heading `.SH HEADING` (each renderer writes one;
/// a subcommand's synopsis and options go under a `.SS` of their own).
fn without_heading(rendered: &[u8], heading: &str) -> Vec<u8> {
    let text = String::from_utf8_lossy(rendered);
    let line = format!(".SH {heading}\n");
    let kept: String = text.split_inclusive('\n').filter(|l| *l != line).collect();
    kept.into_bytes()
}

/// A COMMANDS section: for each visible subcommand of `cmd` (built), its synopsis, what it does
/// and its own options, through `clap_mangen`; the global options are under OPTIONS already.
fn commands_section(cmd: &clap::Command) -> io::Result<Vec<u8>> {
    let mut out = b".SH COMMANDS\n".to_vec();
    for sub in cmd.get_subcommands().filter(|s| !s.is_hide_set()) {
        let shared: Vec<clap::Id> = sub
            .get_arguments()
            .filter(|a| a.is_global_set() || matches!(a.get_id().as_str(), "help" | "version"))
            .map(|a| a.get_id().clone())
            .collect();
        let mut own = sub.clone();
        for id in shared {
            own = own.mut_arg(id, |a| a.hide(true));
        }
        let name = own.get_bin_name().unwrap_or_else(|| own.get_name()).to_owned();
        let about = own.get_long_about().or_else(|| own.get_about()).map(ToString::to_string).unwrap_or_default();
        let page = clap_mangen::Man::new(own);
        out.extend_from_slice(format!(".SS \"{}\"\n", name.replace('-', "\\-")).as_bytes());
        let mut synopsis = Vec::new();
        page.render_synopsis_section(&mut synopsis)?;
        out.extend(without_heading(&synopsis, "SYNOPSIS"));
        out.extend_from_slice(b".PP\n");
        out.extend_from_slice(ctl::roff_text(&about).as_bytes());
        let mut options = Vec::new();
        page.render_options_section(&mut options)?;
        out.extend(without_heading(&options, "OPTIONS"));
    }
    Ok(out)
}

/// The man page `gpushared(8)`.
fn gpushared_page() -> io::Result<Vec<u8>> {
    let page = man(GpusharedCli::command(), "8", "gpushare node daemon: GPU memory as a Kubernetes device plugin");
    let description = r#".B gpushared
runs on every GPU host of a Kubernetes cluster.
It discovers the host's GPUs through NVML (or takes them from a static list in its configuration),
serves the kubelet's device plugin API (v1beta1) for GPU memory, one device per MiB or GiB of each GPU,
resolves which pod and container each allocation is for,
and records every allocation in a durable SQLite ledger before it answers the kubelet.
It serves only pods that
.BR gpushare\-extender (8)
placed, reading their assignment annotation through the API server.
.PP
While it runs it follows kubelet restarts (registering again),
reconciles its ledger with the kubelet's PodResources record,
publishes its GPUs and allocations in the \fBgpushare.io/node\-state\fR annotation of its Node,
withdraws GPUs that fail (Xid and ECC events, probes that get no answer) and brings them back when they recover,
and answers
.BR gpusharectl (1)
through its status API on the D\-Bus system bus (\fBio.gpushare.GpuShare1\fR).
.PP
The configuration is read from \fI/etc/gpushare/gpushared.toml\fR, or from the file \fB\-\-config\fR names.
A missing file at the default path means every default; a file named with \fB\-\-config\fR must exist.
Unknown keys and bad values are refused with the file, the line and what to write instead;
\fB\-\-check\-config\fR checks a file without starting the daemon.
Every key is described in \fI/usr/share/doc/gpushared/gpushared.md\fR.
.PP
The daemon is run by systemd as \fBgpushared.service\fR, a \fBType=notify\fR service:
it reports readiness once the ledger is restored and the plugin socket serves,
a status line as GPUs and allocations change,
and watchdog pings while the allocator and the ledger answer and the main loop turns.
SIGTERM or SIGINT stops it: the plugin socket is removed and it exits with status 0.
Logs go to standard error (the journal, under systemd).
"#;
    let tail = r#".SH "EXIT STATUS"
.TP
\fB0\fR
Stopped by SIGTERM or SIGINT, or \fB\-\-check\-config\fR accepted the file.
.TP
\fB1\fR
Serving is impossible: the configuration, NVML, the ledger, the size of the device list or the kubelet's answer to the registration;
the last line on standard error names the problem and the fix.
With \fB\-\-check\-config\fR: the file is refused, with the reason.
.TP
\fB2\fR
A usage error.
.SH ENVIRONMENT
.TP
\fBNODE_NAME\fR
This node's name in Kubernetes when the configuration sets no \fBnode_name\fR; without either, the host name.
.TP
\fBRUST_LOG\fR
Which log lines are written, such as \fBdebug\fR or \fBgpushared=debug\fR (default \fBinfo\fR).
.TP
\fBNOTIFY_SOCKET\fR, \fBWATCHDOG_USEC\fR, \fBWATCHDOG_PID\fR
Set by systemd: where readiness, status and watchdog pings go, and how often.
.SH FILES
.TP
\fI/etc/gpushare/gpushared.toml\fR
The configuration file.
.TP
\fI/var/lib/gpushare/ledger.db\fR
The allocation ledger, SQLite in WAL mode (\fB[ledger] path\fR), root's only.
A corrupt or unreadable ledger is never replaced silently: it is renamed to \fIledger.db.corrupt\-\fRUNIX\-MS and the daemon starts a new one.
.TP
\fI/var/lib/kubelet/device\-plugins/gpushared.sock\fR
The plugin socket the kubelet calls; \fIkubelet.sock\fR in the same directory is where the daemon registers.
.TP
\fI/var/lib/kubelet/pod\-resources/kubelet.sock\fR
The kubelet's PodResources API, read to reconcile the ledger.
.TP
\fI/etc/kubernetes/kubelet.conf\fR
The credentials for the API server by default (\fB[kubernetes] kubeconfig\fR): the kubelet's own.
.TP
\fBgpushared.service\fR
The systemd unit that runs the daemon:
\fBsystemctl status gpushared\fR shows its status line, \fBjournalctl \-u gpushared\fR its log.
.TP
\fI/run/gpushare/mps.env\fR, \fBgpushared\-mps.service\fR
For the GPUs in MPS mode (\fB[sharing] mps\fR): the environment file the daemon writes at start,
and the unit that runs NVIDIA's MPS control daemon from it.
"#;
    let see_also = format!(
        r#".BR gpusharectl (1),
.BR gpushare\-extender (8),
.BR kubectl\-inspect\-gpushare (1),
.BR systemctl (1),
.BR journalctl (1)
.PP
The documentation, online:
.UR {DOCS}/gpushared.md
.UE
"#
    );
    let out = head(&page, description)?;
    finish(out, &page, tail, &see_also)
}

/// The man page `gpushare-extender(8)`, with its `simulate` subcommand.
fn extender_page() -> io::Result<Vec<u8>> {
    let mut cmd = ExtenderCli::command().disable_help_subcommand(true);
    cmd.build();
    let commands = commands_section(&cmd)?;
    let page = man(cmd, "8", "gpushare scheduler extender: places GPU-memory pods for kube-scheduler");
    let description = r#".B gpushare\-extender
runs beside kube\-scheduler.
It watches Nodes and Pods, keeps a view of every gpushare GPU and what is allocated on it
(from the annotations each node's
.BR gpushared (8)
publishes), and answers kube\-scheduler's extender calls over HTTP:
which nodes can take a pod's GPU memory (filter), how good each is (prioritize),
which victims really free a GPU (preempt);
and it binds the pod itself, with one Binding that carries the GPU assignment (bind).
It also serves \fB/healthz\fR, \fB/readyz\fR (200 once the first lists of Nodes and Pods are in)
and \fB/version\fR; \fB/metrics\fR (Prometheus) and the inspect view, which name every tenant's pods,
are served on a listener of their own (default \fB127.0.0.1:39998\fR).
It keeps nothing on disk: after a restart its view is rebuilt from the API server.
.PP
The configuration is read from \fI/etc/gpushare/gpushare\-extender.toml\fR, or from the file \fB\-\-config\fR names:
the listening addresses (default \fB127.0.0.1:39999\fR for kube\-scheduler, \fB127.0.0.1:39998\fR for metrics), the URL prefix of the verbs (default \fB/gpushare\-scheduler\fR),
TLS and the client CA (an address beyond loopback is refused without one), the credentials, the resource names and unit, the scheduler profiles it binds for, and the placement policies.
A missing file at the default path means every default; a file named with \fB\-\-config\fR must exist.
Unknown keys and bad values are refused with the file, the line and what to write instead;
\fB\-\-check\-config\fR checks a file without starting.
Every key is described in \fI/usr/share/doc/gpushare\-extender/extender.md\fR,
and wiring it into kube\-scheduler in \fIscheduler\-setup.md\fR there.
.PP
The \fBsimulate\fR command places Pod manifests on a described cluster offline, with the same decisions, and prints the result.
.PP
The extender is run by systemd as \fBgpushare\-extender.service\fR (\fBType=notify\fR:
ready once it listens; the status line says whether its view has synced; a watchdog).
SIGTERM or SIGINT stops it cleanly. Logs go to standard error (the journal, under systemd).
"#;
    let tail = r#".SH "EXIT STATUS"
.TP
\fB0\fR
Stopped by SIGTERM or SIGINT, \fB\-\-check\-config\fR accepted the file, or \fBsimulate\fR printed its result.
.TP
\fB1\fR
The configuration is refused, the address cannot be bound, the API server cannot be reached,
or \fBsimulate\fR cannot read its files; one line on standard error says why.
.TP
\fB2\fR
A usage error.
.SH ENVIRONMENT
.TP
\fBKUBECONFIG\fR
The credentials for the API server when the configuration sets no \fB[kubernetes] kubeconfig\fR;
without it \fI~/.kube/config\fR, then the in\-cluster service account.
.TP
\fBRUST_LOG\fR
Which log lines are written, such as \fBdebug\fR (default \fBinfo\fR).
.SH FILES
.TP
\fI/etc/gpushare/gpushare\-extender.toml\fR
The configuration file; the shipped one lists every key at its default, but sets
\fB[kubernetes] kubeconfig\fR to \fI/etc/gpushare/gpushare\-extender.kubeconfig\fR: the extender's
own identity, the user gpushare\-extender, bound to the ClusterRole of
\fI/usr/share/gpushare\-extender/gpushare\-extender\-rbac.yaml\fR.
.TP
\fI/etc/gpushare/kube\-scheduler\-config.yaml\fR
The KubeSchedulerConfiguration that wires the extender into kube\-scheduler (its \fB\-\-config\fR);
\fI/usr/share/doc/gpushare\-extender/examples\fR has the variant with Alibaba's resource names and a kube\-scheduler.service drop\-in.
.TP
\fBgpushare\-extender.service\fR
The systemd unit that runs the extender:
\fBsystemctl status gpushare\-extender\fR, \fBjournalctl \-u gpushare\-extender\fR.
"#;
    let see_also = format!(
        r#".BR kubectl\-inspect\-gpushare (1),
.BR gpushared (8),
.BR gpusharectl (1),
.BR systemctl (1)
.PP
The documentation, online:
.UR {DOCS}/extender.md
.UE
.br
and the simulator's cluster description:
.UR {DOCS}/simulate.md
.UE
"#
    );
    let mut out = head(&page, description)?;
    out.extend(commands);
    finish(out, &page, tail, &see_also)
}

/// The man page `kubectl-inspect-gpushare(1)`.
fn inspect_page() -> io::Result<Vec<u8>> {
    let page = man(InspectCli::command(), "1", "show the GPU memory allocated and free on each gpushare node");
    let description = r#".B kubectl\-inspect\-gpushare
shows, for each gpushare node of the cluster, each GPU's memory allocated and in total,
in the tables users of Alibaba's \fBkubectl inspect gpushare\fR know;
with \fB\-d\fR, what each pod holds on each GPU.
It reads the Nodes (the \fBgpushare.io/node\-state\fR annotation each node's
.BR gpushared (8)
publishes) and the Pods through the API server,
with the credentials of \fBKUBECONFIG\fR, else \fI~/.kube/config\fR, else the in\-cluster service account.
The figures are in the cluster's unit (MiB or GiB), the one most nodes publish.
.PP
Installed on the \fBPATH\fR, it is a kubectl plugin: \fBkubectl inspect gpushare\fR runs it.
"#;
    let tail = r#".SH "EXIT STATUS"
.TP
\fB0\fR
The report was printed.
.TP
\fB1\fR
No usable credentials, the API server did not answer within 15 seconds or refused the lists,
or \fINODE\fR is not a gpushare node; one line on standard error says why.
.TP
\fB2\fR
A usage error.
.SH ENVIRONMENT
.TP
\fBKUBECONFIG\fR
The kubeconfig to read (default \fI~/.kube/config\fR).
.SH EXAMPLES
.TP
\fBkubectl inspect gpushare\fR
Every gpushare node, one line each: its address, each GPU's allocated and total memory, and the node's.
.TP
\fBkubectl inspect gpushare \-d\fR \fInode\-1\fR
The GPUs of \fInode\-1\fR and the pods holding memory on each.
.TP
\fBkubectl inspect gpushare \-o json\fR
The whole report as JSON, for scripts.
"#;
    let see_also = format!(
        r#".BR kubectl (1),
.BR gpushare\-extender (8),
.BR gpushared (8),
.BR gpusharectl (1)
.PP
The documentation, online:
.UR {DOCS}/extender.md
.UE
"#
    );
    let out = head(&page, description)?;
    finish(out, &page, tail, &see_also)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn roff_text_escapes() {
        assert_eq!(ctl::roff_text(".start\n'quote\na-b \\ c"), "\\&.start\n\\&'quote\na\\-b \\e c\n");
    }

    #[test]
    fn title_first_moves_only_the_title() {
        let page = b".ie \\n(.g .ds Aq \\(aq\n.el .ds Aq '\n.TH x 8\n.SH NAME\nx\n";
        assert_eq!(title_first(page), b".TH x 8\n.ie \\n(.g .ds Aq \\(aq\n.el .ds Aq '\n.SH NAME\nx\n");
        assert_eq!(title_first(b".SH NAME\n"), b".SH NAME\n");
    }

    #[test]
    fn without_heading_drops_the_heading_line_only() {
        let rendered = b".ie \\n(.g .ds Aq \\(aq\n.SH OPTIONS\n.TP\nx\n";
        assert_eq!(without_heading(rendered, "OPTIONS"), b".ie \\n(.g .ds Aq \\(aq\n.TP\nx\n");
        assert_eq!(without_heading(b".TP\n", "OPTIONS"), b".TP\n");
    }

    #[test]
    fn the_extender_page_documents_simulate_without_repeating_the_global_options() {
        let page = String::from_utf8(extender_page().unwrap()).unwrap();
        let start = page.find(".SS \"gpushare\\-extender simulate\"").expect("a simulate subsection");
        let end = page.find(".SH \"EXIT STATUS\"").expect("an EXIT STATUS section");
        let simulate = &page[start..end];
        for flag in ["cluster", "workload", "gpu\\-policy", "node\\-policy", "alibaba", "show\\-annotations"] {
            assert!(simulate.contains(&format!("\\fB\\-\\-{flag}\\fR")), "--{flag}: {simulate}");
        }
        assert!(simulate.contains("[default: binpack]"), "{simulate}");
        for global in ["config", "help", "version"] {
            assert!(!simulate.contains(&format!("\\-\\-{global}")), "--{global} is under OPTIONS: {simulate}");
        }
        assert_eq!(page.matches(".SH OPTIONS").count(), 1, "{page}");
        assert_eq!(page.matches(".SH SYNOPSIS").count(), 1, "{page}");
        assert!(!page.contains("gpushare\\-extender\\-simulate(8)"), "no references to per-command pages");
    }
}
