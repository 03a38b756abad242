//! The extender's Prometheus metrics, kept with atomics and rendered in the text exposition
//! format: request latency histograms per verb, bind outcomes, disagreements with the daemons,
//! and per-GPU used/total taken from the cluster view at scrape time.

use std::fmt::Write as _;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

/// Histogram bucket upper bounds, in seconds.
pub const BUCKETS: [f64; 12] = [0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 5.0];

/// The verbs and pages timed.
pub const VERBS: [&str; 4] = ["filter", "prioritize", "bind", "preempt"];

/// How a bind ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BindOutcome {
    /// Bound (or found already bound by an earlier try).
    Bound,
    /// The pod no longer fits the node.
    NoFit,
    /// The API server refused or failed.
    Failed,
    /// The request made no sense (unknown pod, wrong node).
    Invalid,
    /// Deferred: the node is still admitting a pod the kubelet cannot tell from this one.
    Deferred,
}

impl BindOutcome {
    const ALL: [BindOutcome; 5] =
        [BindOutcome::Bound, BindOutcome::NoFit, BindOutcome::Failed, BindOutcome::Invalid, BindOutcome::Deferred];

    fn label(self) -> &'static str {
        match self {
            BindOutcome::Bound => "bound",
            BindOutcome::NoFit => "no_fit",
            BindOutcome::Failed => "failed",
            BindOutcome::Invalid => "invalid",
            BindOutcome::Deferred => "deferred",
        }
    }
}

#[derive(Debug, Default)]
struct Histogram {
    buckets: [AtomicU64; BUCKETS.len()],
    count: AtomicU64,
    sum_micros: AtomicU64,
}

impl Histogram {
    fn observe(&self, d: Duration) {
        let secs = d.as_secs_f64();
        for (b, bound) in self.buckets.iter().zip(BUCKETS) {
            if secs <= bound {
                b.fetch_add(1, Ordering::Relaxed);
            }
        }
        self.count.fetch_add(1, Ordering::Relaxed);
        self.sum_micros.fetch_add(u64::try_from(d.as_micros()).unwrap_or(u64::MAX), Ordering::Relaxed);
    }
}

/// One node's heartbeat for the scrape.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NodeSample {
    /// Node.
    pub node: String,
    /// Seconds since the extender saw its daemon renew its heartbeat, if it renews one.
    pub heartbeat_age_seconds: Option<u64>,
    /// No renewal for three periods: no new pod is placed there.
    pub stale: bool,
}

/// One GPU's figures for the scrape.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct GpuSample {
    /// Node.
    pub node: String,
    /// NVML index.
    pub index: u32,
    /// UUID.
    pub uuid: String,
    /// Used MiB in the reconciled view.
    pub used_mib: u64,
    /// Capacity in MiB.
    pub total_mib: u64,
    /// Healthy, not cordoned, and not handed out whole.
    pub schedulable: bool,
    /// DRA claim shares prepared on it, as its daemon reported.
    pub claims: u64,
    /// The memory those claims hold (part of `used_mib`).
    pub claimed_mib: u64,
    /// Containers over their budget on it, as its daemon reported.
    pub over_budget: Vec<OverBudgetSample>,
}

/// A container over its budget on a GPU, for the scrape.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct OverBudgetSample {
    /// `namespace/name`.
    pub pod: String,
    /// The container (empty when not tied to one).
    pub container: String,
    /// Memory its processes use on the GPU.
    pub in_use_mib: u64,
    /// Its budget there.
    pub budget_mib: u64,
}

/// All counters.
#[derive(Debug, Default)]
pub struct Metrics {
    latency: [Histogram; VERBS.len()],
    binds: [AtomicU64; 5],
    bad_requests: AtomicU64,
}

impl Metrics {
    /// Records one verb's latency.
    pub fn observe(&self, verb: &str, d: Duration) {
        if let Some(i) = VERBS.iter().position(|v| *v == verb) {
            self.latency[i].observe(d);
        }
    }

    /// Counts a bind outcome.
    pub fn bind(&self, outcome: BindOutcome) {
        if let Some(i) = BindOutcome::ALL.iter().position(|o| *o == outcome) {
            self.binds[i].fetch_add(1, Ordering::Relaxed);
        }
    }

    /// Counts a request refused with HTTP 400.
    pub fn bad_request(&self) {
        self.bad_requests.fetch_add(1, Ordering::Relaxed);
    }

    /// Binds that ended with `outcome` so far.
    #[must_use]
    pub fn binds(&self, outcome: BindOutcome) -> u64 {
        BindOutcome::ALL.iter().position(|o| *o == outcome).map_or(0, |i| self.binds[i].load(Ordering::Relaxed))
    }

    /// The exposition text; `gpus`, `view_checks` (disagreements with the daemons, pods whose
    /// placement annotation is not counted) and `view` (nodes, pods, in-flight binds) come from
    /// the view at scrape time.
    #[must_use]
    pub fn render(
        &self,
        nodes: &[NodeSample],
        gpus: &[GpuSample],
        (disagreements, invalid): (u64, usize),
        view: (usize, usize, usize),
        ready: bool,
    ) -> String {
        let mut out = String::new();
        out.push_str("# HELP gpushare_extender_request_duration_seconds Time to answer kube-scheduler, per verb.\n");
        out.push_str("# TYPE gpushare_extender_request_duration_seconds histogram\n");
        for (verb, h) in VERBS.iter().zip(&self.latency) {
            for (b, bound) in h.buckets.iter().zip(BUCKETS) {
                let _ = writeln!(
                    out,
                    "gpushare_extender_request_duration_seconds_bucket{{verb=\"{verb}\",le=\"{bound}\"}} {}",
                    b.load(Ordering::Relaxed)
                );
            }
            let count = h.count.load(Ordering::Relaxed);
            let _ = writeln!(
                out,
                "gpushare_extender_request_duration_seconds_bucket{{verb=\"{verb}\",le=\"+Inf\"}} {count}"
            );
            #[allow(clippy::cast_precision_loss)]
            let sum = h.sum_micros.load(Ordering::Relaxed) as f64 / 1e6;
            let _ = writeln!(out, "gpushare_extender_request_duration_seconds_sum{{verb=\"{verb}\"}} {sum}");
            let _ = writeln!(out, "gpushare_extender_request_duration_seconds_count{{verb=\"{verb}\"}} {count}");
        }
        out.push_str("# HELP gpushare_extender_binds_total Bind calls by outcome.\n");
        out.push_str("# TYPE gpushare_extender_binds_total counter\n");
        for (o, c) in BindOutcome::ALL.iter().zip(&self.binds) {
            let _ = writeln!(
                out,
                "gpushare_extender_binds_total{{outcome=\"{}\"}} {}",
                o.label(),
                c.load(Ordering::Relaxed)
            );
        }
        out.push_str("# HELP gpushare_extender_bad_requests_total Requests refused as malformed (HTTP 400).\n");
        out.push_str("# TYPE gpushare_extender_bad_requests_total counter\n");
        let _ = writeln!(out, "gpushare_extender_bad_requests_total {}", self.bad_requests.load(Ordering::Relaxed));
        out.push_str(
            "# HELP gpushare_extender_view_disagreements_total Allocations a daemon reported differently from the extender's view.\n",
        );
        out.push_str("# TYPE gpushare_extender_view_disagreements_total counter\n");
        let _ = writeln!(out, "gpushare_extender_view_disagreements_total {disagreements}");
        out.push_str(
            "# HELP gpushare_extender_invalid_assignments Pods whose placement annotation is not counted: unreadable, or not matching the pod's spec.\n",
        );
        out.push_str("# TYPE gpushare_extender_invalid_assignments gauge\n");
        let _ = writeln!(out, "gpushare_extender_invalid_assignments {invalid}");
        out.push_str("# HELP gpushare_extender_ready Whether the cluster view has synced.\n");
        out.push_str("# TYPE gpushare_extender_ready gauge\n");
        let _ = writeln!(out, "gpushare_extender_ready {}", u8::from(ready));
        out.push_str("# HELP gpushare_extender_view_objects Objects in the cluster view.\n");
        out.push_str("# TYPE gpushare_extender_view_objects gauge\n");
        let _ = writeln!(out, "gpushare_extender_view_objects{{kind=\"nodes\"}} {}", view.0);
        let _ = writeln!(out, "gpushare_extender_view_objects{{kind=\"gpu_pods\"}} {}", view.1);
        let _ = writeln!(out, "gpushare_extender_view_objects{{kind=\"inflight_binds\"}} {}", view.2);
        out.push_str(
            "# HELP gpushare_node_heartbeat_age_seconds Seconds since the node's gpushared last renewed its heartbeat.\n",
        );
        out.push_str("# TYPE gpushare_node_heartbeat_age_seconds gauge\n");
        for n in nodes {
            if let Some(age) = n.heartbeat_age_seconds {
                let _ = writeln!(out, "gpushare_node_heartbeat_age_seconds{{node=\"{}\"}} {age}", escape(&n.node));
            }
        }
        out.push_str(
            "# HELP gpushare_node_stale Whether the node's gpushared stopped renewing its heartbeat (no new pods there).\n",
        );
        out.push_str("# TYPE gpushare_node_stale gauge\n");
        for n in nodes {
            let _ = writeln!(out, "gpushare_node_stale{{node=\"{}\"}} {}", escape(&n.node), u8::from(n.stale));
        }
        per_gpu(&mut out, "gpushare_gpu_memory_used_mib", "GPU memory in use, reconciled view.", gpus, |g| g.used_mib);
        per_gpu(&mut out, "gpushare_gpu_memory_total_mib", "GPU memory that can be allocated.", gpus, |g| g.total_mib);
        per_gpu(
            &mut out,
            "gpushare_gpu_schedulable",
            "Whether the GPU takes allocations (healthy, not cordoned).",
            gpus,
            |g| u64::from(g.schedulable),
        );
        per_gpu(
            &mut out,
            "gpushare_gpu_dra_claims",
            "DRA ResourceClaim shares prepared on the GPU, as its daemon reported.",
            gpus,
            |g| g.claims,
        );
        per_gpu(
            &mut out,
            "gpushare_gpu_memory_claimed_mib",
            "GPU memory DRA claims hold (part of gpushare_gpu_memory_used_mib).",
            gpus,
            |g| g.claimed_mib,
        );
        per_gpu(
            &mut out,
            "gpushare_gpu_containers_over_budget",
            "Containers whose processes use more of the GPU than their budget, as its daemon last sampled.",
            gpus,
            |g| u64::try_from(g.over_budget.len()).unwrap_or(u64::MAX),
        );
        for (name, help, value) in [
            (
                "gpushare_container_gpu_memory_in_use_mib",
                "GPU memory the processes of a container over its budget use (only containers over budget).",
                (|o: &OverBudgetSample| o.in_use_mib) as fn(&OverBudgetSample) -> u64,
            ),
            (
                "gpushare_container_gpu_memory_budget_mib",
                "The budget of a container over it (only containers over budget; 0: no budget on the GPU).",
                |o: &OverBudgetSample| o.budget_mib,
            ),
        ] {
            let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} gauge");
            for g in gpus {
                for o in &g.over_budget {
                    let (namespace, pod) = o.pod.split_once('/').unwrap_or(("", &o.pod));
                    let _ = writeln!(
                        out,
                        "{name}{{node=\"{}\",gpu=\"{}\",namespace=\"{}\",pod=\"{}\",container=\"{}\"}} {}",
                        escape(&g.node),
                        g.index,
                        escape(namespace),
                        escape(pod),
                        escape(&o.container),
                        value(o)
                    );
                }
            }
        }
        out
    }
}

/// One gauge with a sample per GPU.
fn per_gpu(out: &mut String, name: &str, help: &str, gpus: &[GpuSample], value: impl Fn(&GpuSample) -> u64) {
    let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} gauge");
    for g in gpus {
        let _ = writeln!(
            out,
            "{name}{{node=\"{}\",gpu=\"{}\",uuid=\"{}\"}} {}",
            escape(&g.node),
            g.index,
            escape(&g.uuid),
            value(g)
        );
    }
}

/// Escapes a label value.
fn escape(s: &str) -> String {
    s.replace('\\', "\\\\").replace('"', "\\\"").replace('\n', "\\n")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn renders_cumulative_buckets_and_labels() {
        let m = Metrics::default();
        m.observe("filter", Duration::from_micros(700));
        m.observe("filter", Duration::from_millis(30));
        m.bind(BindOutcome::Bound);
        let gpu = GpuSample {
            node: "n\"1".into(),
            index: 0,
            uuid: "GPU-a".into(),
            used_mib: 100,
            total_mib: 200,
            schedulable: true,
            claims: 2,
            claimed_mib: 60,
            over_budget: vec![OverBudgetSample {
                pod: "ml/train".into(),
                container: "main".into(),
                in_use_mib: 450,
                budget_mib: 300,
            }],
        };
        let nodes = [
            NodeSample { node: "n\"1".into(), heartbeat_age_seconds: Some(75), stale: true },
            NodeSample { node: "old".into(), heartbeat_age_seconds: None, stale: false },
        ];
        let text = m.render(&nodes, &[gpu], (2, 1), (1, 2, 0), true);
        assert!(text.contains("gpushare_extender_invalid_assignments 1\n"), "{text}");
        assert!(text.contains("gpushare_node_heartbeat_age_seconds{node=\"n\\\"1\"} 75\n"), "{text}");
        assert!(!text.contains("gpushare_node_heartbeat_age_seconds{node=\"old\"}"), "{text}");
        assert!(
            text.contains("gpushare_node_stale{node=\"n\\\"1\"} 1\ngpushare_node_stale{node=\"old\"} 0\n"),
            "{text}"
        );
        assert!(
            text.contains("gpushare_gpu_containers_over_budget{node=\"n\\\"1\",gpu=\"0\",uuid=\"GPU-a\"} 1\n"),
            "{text}"
        );
        assert!(text.contains(
            "gpushare_container_gpu_memory_in_use_mib{node=\"n\\\"1\",gpu=\"0\",namespace=\"ml\",pod=\"train\",container=\"main\"} 450\n"
        ), "{text}");
        assert!(text.contains("# TYPE gpushare_container_gpu_memory_budget_mib gauge\ngpushare_container_gpu_memory_budget_mib{node=\"n\\\"1\",gpu=\"0\",namespace=\"ml\",pod=\"train\",container=\"main\"} 300\n"), "{text}");
        assert!(text.contains("gpushare_extender_request_duration_seconds_bucket{verb=\"filter\",le=\"0.0005\"} 0\n"));
        assert!(text.contains("gpushare_extender_request_duration_seconds_bucket{verb=\"filter\",le=\"0.001\"} 1\n"));
        assert!(text.contains("gpushare_extender_request_duration_seconds_bucket{verb=\"filter\",le=\"0.05\"} 2\n"));
        assert!(text.contains("gpushare_extender_request_duration_seconds_count{verb=\"filter\"} 2\n"));
        assert!(text.contains("gpushare_extender_binds_total{outcome=\"bound\"} 1\n"));
        assert!(text.contains("gpushare_gpu_memory_used_mib{node=\"n\\\"1\",gpu=\"0\",uuid=\"GPU-a\"} 100\n"));
        assert!(text.contains("gpushare_gpu_dra_claims{node=\"n\\\"1\",gpu=\"0\",uuid=\"GPU-a\"} 2\n"), "{text}");
        assert!(
            text.contains("gpushare_gpu_memory_claimed_mib{node=\"n\\\"1\",gpu=\"0\",uuid=\"GPU-a\"} 60\n"),
            "{text}"
        );
        assert!(text.contains("gpushare_extender_view_disagreements_total 2\n"));
    }
}
