//! Server-side printing: `kubectl get` asks for `application/json;as=Table;v=v1;g=meta.k8s.io`
//! and prints the server's columns. The stand-in answers with the columns the real server
//! prints for Pods (`NAME READY STATUS RESTARTS AGE`, and `IP NODE` with `-o wide`) and Nodes
//! (`NAME STATUS ROLES AGE VERSION`).

use serde_json::{Value, json};

use super::Kind;

/// Whether an `Accept` header asks for a Table.
pub(super) fn wants_table(accept: &str) -> bool {
    accept.split(',').next().is_some_and(|first| first.contains("as=Table"))
}

/// `value` (an object or a list of `kind`) as a `meta.k8s.io/v1` Table, ages counted to
/// `now_s` (Unix seconds).
pub(super) fn table(kind: Kind, value: &Value, now_s: i64) -> Value {
    let items: Vec<&Value> = match value.get("items").and_then(Value::as_array) {
        Some(items) => items.iter().collect(),
        None => vec![value],
    };
    let column = |name: &str, ty: &str, priority: u8| {
        json!({"name": name, "type": ty, "format": if name == "Name" { "name" } else { "" },
               "description": "", "priority": priority})
    };
    let columns = match kind {
        Kind::Pod => vec![
            column("Name", "string", 0),
            column("Ready", "string", 0),
            column("Status", "string", 0),
            column("Restarts", "string", 0),
            column("Age", "string", 0),
            column("IP", "string", 1),
            column("Node", "string", 1),
        ],
        Kind::Node => vec![
            column("Name", "string", 0),
            column("Status", "string", 0),
            column("Roles", "string", 0),
            column("Age", "string", 0),
            column("Version", "string", 0),
        ],
    };
    let rows: Vec<Value> = items
        .iter()
        .map(|o| {
            let cells = match kind {
                Kind::Pod => pod_cells(o, now_s),
                Kind::Node => node_cells(o, now_s),
            };
            json!({"cells": cells, "object": {"kind": "PartialObjectMetadata", "apiVersion": "meta.k8s.io/v1",
                   "metadata": o["metadata"].clone()}})
        })
        .collect();
    let resource_version = value["metadata"]["resourceVersion"].clone();
    json!({"kind": "Table", "apiVersion": "meta.k8s.io/v1",
           "metadata": {"resourceVersion": resource_version}, "columnDefinitions": columns, "rows": rows})
}

fn text(v: &Value) -> String {
    v.as_str().unwrap_or("").to_owned()
}

fn pod_cells(pod: &Value, now_s: i64) -> Vec<Value> {
    let containers = pod["spec"]["containers"].as_array().map_or(0, Vec::len);
    let statuses = pod["status"]["containerStatuses"].as_array().cloned().unwrap_or_default();
    let ready = statuses.iter().filter(|s| s["ready"].as_bool() == Some(true)).count();
    let restarts: i64 = statuses.iter().filter_map(|s| s["restartCount"].as_i64()).sum();
    let status = if pod["metadata"]["deletionTimestamp"].is_string() {
        "Terminating".to_owned()
    } else {
        pod["status"]["phase"].as_str().unwrap_or("Pending").to_owned()
    };
    let or_none = |s: String| if s.is_empty() { "<none>".to_owned() } else { s };
    vec![
        json!(text(&pod["metadata"]["name"])),
        json!(format!("{ready}/{containers}")),
        json!(status),
        json!(restarts.to_string()),
        json!(age(&pod["metadata"]["creationTimestamp"], now_s)),
        json!(or_none(text(&pod["status"]["podIP"]))),
        json!(or_none(text(&pod["spec"]["nodeName"]))),
    ]
}

fn node_cells(node: &Value, now_s: i64) -> Vec<Value> {
    let ready = node["status"]["conditions"]
        .as_array()
        .and_then(|c| c.iter().find(|c| c["type"] == "Ready"))
        .map(|c| c["status"].as_str().unwrap_or(""));
    let status = match ready {
        Some("True") => "Ready",
        Some("False") => "NotReady",
        _ => "Unknown",
    };
    let mut status = status.to_owned();
    if node["spec"]["unschedulable"].as_bool() == Some(true) {
        status.push_str(",SchedulingDisabled");
    }
    let roles: Vec<&str> = node["metadata"]["labels"]
        .as_object()
        .map(|l| l.keys().filter_map(|k| k.strip_prefix("node-role.kubernetes.io/")).collect())
        .unwrap_or_default();
    let version = text(&node["status"]["nodeInfo"]["kubeletVersion"]);
    vec![
        json!(text(&node["metadata"]["name"])),
        json!(status),
        json!(if roles.is_empty() { "<none>".to_owned() } else { roles.join(",") }),
        json!(age(&node["metadata"]["creationTimestamp"], now_s)),
        json!(if version.is_empty() { "<unknown>".to_owned() } else { version }),
    ]
}

/// Seconds since the Unix epoch of an RFC 3339 time (`2026-11-23T10:00:00Z`).
fn unix_seconds(t: &str) -> Option<i64> {
    gpushare_core::time::parse_rfc3339(t).map(|ms| ms.div_euclid(1000))
}

/// The age as `kubectl` prints it: `45s`, `12m`, `3h25m`, `2d4h`, `40d`.
fn age(created: &Value, now_s: i64) -> String {
    let Some(since) = created.as_str().and_then(unix_seconds) else { return "<unknown>".to_owned() };
    let s = (now_s - since).max(0);
    match s {
        0..120 => format!("{s}s"),
        120..600 => format!("{}m{}s", s / 60, s % 60).replace("m0s", "m"),
        600..10_800 => format!("{}m", s / 60),
        10_800..172_800 => format!("{}h{}m", s / 3_600, (s % 3_600) / 60).replace("h0m", "h"),
        172_800..2_592_000 => format!("{}d{}h", s / 86_400, (s % 86_400) / 3_600).replace("d0h", "d"),
        _ => format!("{}d", s / 86_400),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pods_and_nodes_print_as_the_real_server_prints_them() {
        let now = unix_seconds("2026-11-23T10:05:00Z").unwrap();
        let pods = json!({"metadata": {"resourceVersion": "7"}, "items": [
            {"metadata": {"name": "p1", "creationTimestamp": "2026-11-23T10:00:00Z"},
             "spec": {"nodeName": "n1", "containers": [{"name": "a"}, {"name": "b"}]},
             "status": {"phase": "Running", "podIP": "10.0.0.5",
                        "containerStatuses": [{"ready": true, "restartCount": 2}, {"ready": false, "restartCount": 1}]}},
            {"metadata": {"name": "p2", "creationTimestamp": "2026-11-23T10:04:30Z", "deletionTimestamp": "x"},
             "spec": {"containers": [{"name": "a"}]}, "status": {}}]});
        let t = table(Kind::Pod, &pods, now);
        assert_eq!(t["kind"], "Table");
        assert_eq!(t["metadata"]["resourceVersion"], "7");
        assert_eq!(t["rows"][0]["cells"], json!(["p1", "1/2", "Running", "3", "5m", "10.0.0.5", "n1"]));
        assert_eq!(t["rows"][1]["cells"], json!(["p2", "0/1", "Terminating", "0", "30s", "<none>", "<none>"]));
        assert_eq!(t["rows"][0]["object"]["metadata"]["name"], "p1");
        let node = json!({"metadata": {"name": "n1", "creationTimestamp": "2026-11-21T08:00:00Z",
                                       "labels": {"node-role.kubernetes.io/gpu": ""}},
                          "spec": {"unschedulable": true},
                          "status": {"conditions": [{"type": "Ready", "status": "True"}],
                                     "nodeInfo": {"kubeletVersion": "v1.32.4"}}});
        let t = table(Kind::Node, &node, now);
        assert_eq!(t["rows"][0]["cells"], json!(["n1", "Ready,SchedulingDisabled", "gpu", "2d2h", "v1.32.4"]));
    }

    #[test]
    fn ages_and_accept_headers() {
        assert_eq!(unix_seconds("1970-01-01T00:00:00Z"), Some(0));
        assert_eq!(unix_seconds("2000-03-01T00:00:00Z"), Some(951_868_800));
        assert_eq!(unix_seconds("not a time"), None);
        assert_eq!(age(&json!("2026-11-23T10:00:00Z"), unix_seconds("2026-11-23T13:30:00Z").unwrap()), "3h30m");
        assert_eq!(age(&json!(null), 0), "<unknown>");
        assert!(wants_table("application/json;as=Table;v=v1;g=meta.k8s.io,application/json"));
        assert!(!wants_table("application/json"));
        assert!(!wants_table("application/json, application/json;as=Table;v=v1;g=meta.k8s.io"));
    }
}
