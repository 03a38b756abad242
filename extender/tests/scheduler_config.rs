//! The shipped `KubeSchedulerConfiguration` files (`etc/kube-scheduler/*.yaml`) against the rules
//! kube-scheduler applies to `kubescheduler.config.k8s.io/v1` when it loads them: strict decoding
//! (an unknown key is an error), the extender validation (positive weight with `prioritizeVerb`,
//! one binder at most, extended resource names, no duplicates), plus what gpushare needs: the
//! memory resource counted by the scheduler, the count resource not, node names only, and the
//! extender's own address from `etc/gpushare-extender.toml`.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::collections::HashSet;
use std::path::PathBuf;

use serde_json::{Map, Value};

const API_VERSION: &str = "kubescheduler.config.k8s.io/v1";
const KIND: &str = "KubeSchedulerConfiguration";

/// Top-level fields of `KubeSchedulerConfiguration` v1 (kube-scheduler `config/v1/types.go`,
/// with `DebuggingConfiguration` inlined).
const TOP_LEVEL_FIELDS: &[&str] = &[
    "apiVersion",
    "kind",
    "parallelism",
    "leaderElection",
    "clientConnection",
    "enableProfiling",
    "enableContentionProfiling",
    "percentageOfNodesToScore",
    "podInitialBackoffSeconds",
    "podMaxBackoffSeconds",
    "profiles",
    "extenders",
    "delayCacheUntilActive",
];

/// `ClientConnectionConfiguration` (component-base).
const CLIENT_CONNECTION_FIELDS: &[&str] = &["kubeconfig", "acceptContentTypes", "contentType", "qps", "burst"];

/// `Extender` v1.
const EXTENDER_FIELDS: &[&str] = &[
    "urlPrefix",
    "filterVerb",
    "preemptVerb",
    "prioritizeVerb",
    "weight",
    "bindVerb",
    "enableHTTPS",
    "tlsConfig",
    "httpTimeout",
    "nodeCacheCapable",
    "managedResources",
    "ignorable",
];

/// `ExtenderTLSConfig` v1.
const TLS_FIELDS: &[&str] =
    &["insecure", "serverName", "certFile", "keyFile", "caFile", "certData", "keyData", "caData"];

/// `ExtenderManagedResource` v1.
const MANAGED_RESOURCE_FIELDS: &[&str] = &["name", "ignoredByScheduler"];

fn repo_file(relative: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..").join(relative)
}

fn load(relative: &str) -> Value {
    let path = repo_file(relative);
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    serde_saphyr::from_str_with_options::<Value>(&text, gpushare_extender::simulate::yaml_options())
        .unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

fn known_keys(object: &Map<String, Value>, known: &[&str], at: &str) -> Result<(), String> {
    match object.keys().find(|key| !known.contains(&key.as_str())) {
        Some(key) => Err(format!("{at}: unknown field {key:?} (strict decoding rejects it)")),
        None => Ok(()),
    }
}

fn object<'a>(value: &'a Value, at: &str) -> Result<&'a Map<String, Value>, String> {
    value.as_object().ok_or_else(|| format!("{at}: not a mapping"))
}

fn optional_str<'a>(e: &'a Map<String, Value>, key: &str, at: &str) -> Result<Option<&'a str>, String> {
    match e.get(key) {
        None | Some(Value::Null) => Ok(None),
        Some(Value::String(s)) => Ok(Some(s.as_str())),
        Some(_) => Err(format!("{at}.{key}: not a string")),
    }
}

fn optional_bool(e: &Map<String, Value>, key: &str, at: &str) -> Result<bool, String> {
    match e.get(key) {
        None | Some(Value::Null) => Ok(false),
        Some(Value::Bool(b)) => Ok(*b),
        Some(_) => Err(format!("{at}.{key}: not a boolean")),
    }
}

/// A Go `time.ParseDuration` string such as `5s`, `500ms`, `1m30s` or `1.5s`, and positive.
/// Signs are refused: a negative timeout means nothing here.
fn is_positive_go_duration(s: &str) -> bool {
    const UNITS: &[&str] = &["ns", "us", "µs", "μs", "ms", "s", "m", "h"];
    let mut rest = s;
    let mut nonzero = false;
    if rest.is_empty() {
        return false;
    }
    while !rest.is_empty() {
        let number_len = rest.find(|c: char| !c.is_ascii_digit() && c != '.').unwrap_or(rest.len());
        let number = &rest[..number_len];
        if number.is_empty() || number.matches('.').count() > 1 || !number.chars().any(|c| c.is_ascii_digit()) {
            return false;
        }
        nonzero |= number.chars().any(|c| c.is_ascii_digit() && c != '0');
        rest = &rest[number_len..];
        // Longest unit first, so `ms` is not read as `m` followed by `s`.
        let Some(unit) = UNITS.iter().filter(|u| rest.starts_with(**u)).max_by_key(|u| u.len()) else {
            return false;
        };
        rest = &rest[unit.len()..];
    }
    nonzero
}

/// `scheme://host:port/path`, split into its three parts.
fn split_url(url: &str) -> Result<(&str, &str, &str), String> {
    let (scheme, rest) = url.split_once("://").ok_or_else(|| format!("{url:?}: no scheme"))?;
    if scheme != "http" && scheme != "https" {
        return Err(format!("{url:?}: scheme is not http or https"));
    }
    let slash = rest.find('/').ok_or_else(|| format!("{url:?}: no path after host:port"))?;
    let (authority, path) = rest.split_at(slash);
    let (host, port) = authority.rsplit_once(':').ok_or_else(|| format!("{url:?}: no port"))?;
    if host.is_empty() || host.contains(['@', '?', '#']) {
        return Err(format!("{url:?}: bad host"));
    }
    if !matches!(port.parse::<u16>(), Ok(p) if p > 0) {
        return Err(format!("{url:?}: bad port {port:?}"));
    }
    if path.len() < 2 || path.contains(['?', '#', ' ']) {
        return Err(format!("{url:?}: bad path {path:?}"));
    }
    Ok((scheme, authority, path))
}

/// A lowercase DNS-1123 subdomain: dot-separated labels of `[a-z0-9-]`, alphanumeric at both ends.
fn is_dns_subdomain(s: &str) -> bool {
    !s.is_empty()
        && s.len() <= 253
        && s.split('.').all(|label| {
            !label.is_empty()
                && label.len() <= 63
                && label.chars().all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '-')
                && !label.starts_with('-')
                && !label.ends_with('-')
        })
}

/// An extended resource name as Kubernetes accepts it: `domain/name`, the domain a DNS subdomain
/// outside `kubernetes.io` and `k8s.io`, the name a qualified-name part (at most 63 characters of
/// `[A-Za-z0-9._-]`, alphanumeric at both ends).
fn extended_resource_error(name: &str) -> Option<String> {
    let Some((domain, local)) = name.split_once('/') else {
        return Some(format!("{name:?} has no domain prefix"));
    };
    if !is_dns_subdomain(domain) {
        return Some(format!("{name:?}: domain {domain:?} is not a lowercase DNS subdomain"));
    }
    let reserved = ["kubernetes.io", "k8s.io"];
    if reserved.iter().any(|r| domain == *r || domain.ends_with(&format!(".{r}"))) {
        return Some(format!("{name:?} is in a Kubernetes-reserved domain"));
    }
    let alnum_ends =
        local.starts_with(|c: char| c.is_ascii_alphanumeric()) && local.ends_with(|c: char| c.is_ascii_alphanumeric());
    let chars_ok = local.chars().all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'));
    if local.is_empty() || local.len() > 63 || !alnum_ends || !chars_ok {
        return Some(format!("{name:?}: {local:?} is not a valid resource name"));
    }
    None
}

/// Checks one extender; returns its managed resources as (name, ignoredByScheduler).
fn check_extender(e: &Map<String, Value>, at: &str) -> Result<Vec<(String, bool)>, String> {
    known_keys(e, EXTENDER_FIELDS, at)?;

    let url = optional_str(e, "urlPrefix", at)?.ok_or_else(|| format!("{at}.urlPrefix: required"))?;
    let (scheme, _, _) = split_url(url).map_err(|m| format!("{at}.urlPrefix: {m}"))?;
    let https = optional_bool(e, "enableHTTPS", at)?;
    if https != (scheme == "https") {
        return Err(format!("{at}: enableHTTPS is {https} but urlPrefix uses {scheme}"));
    }
    if let Some(tls) = e.get("tlsConfig") {
        known_keys(object(tls, &format!("{at}.tlsConfig"))?, TLS_FIELDS, &format!("{at}.tlsConfig"))?;
    }

    for verb in ["filterVerb", "preemptVerb", "prioritizeVerb", "bindVerb"] {
        if optional_str(e, verb, at)? == Some("") {
            return Err(format!("{at}.{verb}: empty"));
        }
    }
    let weight = match e.get("weight") {
        None | Some(Value::Null) => 0,
        Some(w) => w.as_i64().ok_or_else(|| format!("{at}.weight: not an integer"))?,
    };
    if optional_str(e, "prioritizeVerb", at)?.is_some() && weight <= 0 {
        return Err(format!("{at}: prioritizeVerb is set, so weight must be positive (is {weight})"));
    }

    if let Some(timeout) = optional_str(e, "httpTimeout", at)? {
        if !is_positive_go_duration(timeout) {
            return Err(format!("{at}.httpTimeout: {timeout:?} is not a positive Go duration"));
        }
    } else if e.contains_key("httpTimeout") {
        return Err(format!("{at}.httpTimeout: not a duration string"));
    }

    if !optional_bool(e, "nodeCacheCapable", at)? {
        return Err(format!("{at}: nodeCacheCapable must be true (the extender reads node names)"));
    }
    optional_bool(e, "ignorable", at)?;

    let mut managed = Vec::new();
    let resources: &[Value] = match e.get("managedResources") {
        None | Some(Value::Null) => &[],
        Some(Value::Array(items)) => items,
        Some(_) => return Err(format!("{at}.managedResources: not a list")),
    };
    for (j, r) in resources.iter().enumerate() {
        let rat = format!("{at}.managedResources[{j}]");
        let r = object(r, &rat)?;
        known_keys(r, MANAGED_RESOURCE_FIELDS, &rat)?;
        let name = optional_str(r, "name", &rat)?.ok_or_else(|| format!("{rat}.name: required"))?;
        if let Some(problem) = extended_resource_error(name) {
            return Err(format!("{rat}.name: {problem}"));
        }
        managed.push((name.to_owned(), optional_bool(r, "ignoredByScheduler", &rat)?));
    }
    Ok(managed)
}

/// The first rule of `KubeSchedulerConfiguration` v1, or of gpushare's use of it, that `doc`
/// breaks.
fn check(doc: &Value) -> Result<(), String> {
    let top = object(doc, "document")?;
    known_keys(top, TOP_LEVEL_FIELDS, "top level")?;
    if top.get("apiVersion").and_then(Value::as_str) != Some(API_VERSION) {
        return Err(format!("apiVersion must be {API_VERSION}, is {:?}", top.get("apiVersion")));
    }
    if top.get("kind").and_then(Value::as_str) != Some(KIND) {
        return Err(format!("kind must be {KIND}, is {:?}", top.get("kind")));
    }

    let connection = object(
        top.get("clientConnection").ok_or("clientConnection: required (--kubeconfig is ignored with --config)")?,
        "clientConnection",
    )?;
    known_keys(connection, CLIENT_CONNECTION_FIELDS, "clientConnection")?;
    match optional_str(connection, "kubeconfig", "clientConnection")? {
        Some(path) if path.starts_with('/') && path.len() > 1 => {}
        other => return Err(format!("clientConnection.kubeconfig must be an absolute path, is {other:?}")),
    }

    let extenders = match top.get("extenders") {
        Some(Value::Array(items)) if !items.is_empty() => items,
        _ => return Err("extenders: a non-empty list is required".to_owned()),
    };
    let mut binders = 0;
    let mut names = HashSet::new();
    let mut managed = Vec::new();
    for (i, e) in extenders.iter().enumerate() {
        let at = format!("extenders[{i}]");
        let e = object(e, &at)?;
        let resources = check_extender(e, &at)?;
        if e.get("bindVerb").is_some_and(|v| !v.is_null()) {
            binders += 1;
            if binders > 1 {
                return Err(format!("{at}: a second extender with bindVerb; only one may bind"));
            }
        }
        for (name, ignored) in resources {
            if !names.insert(name.clone()) {
                return Err(format!("{at}: managed resource {name} is listed twice"));
            }
            managed.push((name, ignored));
        }
    }

    let memory = managed.iter().find(|(name, _)| name.ends_with("/gpu-mem"));
    let count = managed.iter().find(|(name, _)| name.ends_with("/gpu-count"));
    match (memory, count) {
        (None, _) => Err("no extender manages a .../gpu-mem resource".to_owned()),
        (_, None) => Err("no extender manages a .../gpu-count resource".to_owned()),
        (Some((name, true)), _) => Err(format!("{name}: must have ignoredByScheduler false (nodes advertise it)")),
        (_, Some((name, false))) => Err(format!("{name}: must have ignoredByScheduler true (no node advertises it)")),
        (Some((mem, false)), Some((cnt, true))) => {
            let domain = |n: &str| n.split('/').next().map(str::to_owned);
            if domain(mem) == domain(cnt) { Ok(()) } else { Err(format!("{mem} and {cnt} are in different domains")) }
        }
    }
}

/// `[server] listen` and `[server] prefix` of the extender's shipped configuration.
fn extender_server_settings() -> (String, String) {
    let path = repo_file("etc/gpushare-extender.toml");
    let text = std::fs::read_to_string(&path).unwrap();
    let config: toml::Table = toml::from_str(&text).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let setting = |key: &str| {
        config["server"][key].as_str().unwrap_or_else(|| panic!("[server] {key} in {}", path.display())).to_owned()
    };
    (setting("listen"), setting("prefix"))
}

fn the_only_extender(doc: &Value) -> &Map<String, Value> {
    let extenders = doc["extenders"].as_array().unwrap();
    assert_eq!(extenders.len(), 1);
    extenders[0].as_object().unwrap()
}

fn check_shipped(relative: &str, memory: &str, count: &str) {
    let doc = load(relative);
    if let Err(problem) = check(&doc) {
        panic!("{relative}: {problem}");
    }
    let e = the_only_extender(&doc);

    let (listen, prefix) = extender_server_settings();
    let (_, authority, path) = split_url(e["urlPrefix"].as_str().unwrap()).unwrap();
    assert_eq!(authority, listen, "{relative}: urlPrefix host:port vs [server] listen");
    assert_eq!(path, prefix, "{relative}: urlPrefix path vs [server] prefix");

    // The verbs the extender serves under its prefix.
    for (key, verb) in
        [("filterVerb", "filter"), ("prioritizeVerb", "prioritize"), ("bindVerb", "bind"), ("preemptVerb", "preempt")]
    {
        assert_eq!(e[key], verb, "{relative}: {key}");
    }
    assert_eq!(e["ignorable"], false, "{relative}: ignorable");
    assert_eq!(e["httpTimeout"], "5s", "{relative}: httpTimeout");

    let managed: Vec<(&str, bool)> = e["managedResources"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| (r["name"].as_str().unwrap(), r["ignoredByScheduler"].as_bool().unwrap()))
        .collect();
    assert_eq!(managed, [(memory, false), (count, true)], "{relative}: managedResources");
}

#[test]
fn the_gpushare_configuration_is_valid_and_points_at_the_extender() {
    check_shipped("etc/kube-scheduler/gpushare-scheduler-config.yaml", "gpushare.io/gpu-mem", "gpushare.io/gpu-count");
}

#[test]
fn the_alibaba_configuration_is_valid_and_points_at_the_extender() {
    check_shipped(
        "etc/kube-scheduler/gpushare-scheduler-config-alibaba.yaml",
        "aliyun.com/gpu-mem",
        "aliyun.com/gpu-count",
    );
}

#[test]
fn the_systemd_drop_in_resets_exec_start_and_uses_the_config() {
    let text = std::fs::read_to_string(repo_file("etc/kube-scheduler/10-gpushare.conf")).unwrap();
    let lines: Vec<&str> = text.lines().filter(|l| !l.starts_with('#') && !l.trim().is_empty()).collect();
    let reset = lines.iter().position(|l| *l == "ExecStart=").expect("an ExecStart= reset");
    let start = lines[reset + 1];
    assert!(start.starts_with("ExecStart=/"), "{start}");
    assert!(start.contains("--config=/etc/gpushare/kube-scheduler-config.yaml"), "{start}");
    assert!(!start.contains("--kubeconfig"), "{start}: ignored with --config");
    for want in ["After=gpushare-extender.service", "Wants=gpushare-extender.service"] {
        assert!(lines.contains(&want), "missing {want}");
    }
}

/// A copy of the shipped configuration with `edit` applied.
fn broken(edit: impl FnOnce(&mut Value)) -> Value {
    let mut doc = load("etc/kube-scheduler/gpushare-scheduler-config.yaml");
    edit(&mut doc);
    doc
}

fn assert_rejected(doc: &Value, mentions: &str) {
    match check(doc) {
        Ok(()) => panic!("accepted, expected a complaint about {mentions}: {doc}"),
        Err(problem) => assert!(problem.contains(mentions), "{problem:?} does not mention {mentions:?}"),
    }
}

#[test]
fn the_checker_rejects_what_kube_scheduler_rejects() {
    assert_rejected(&broken(|d| d["extenders"][0]["weight"] = 0.into()), "weight");
    assert_rejected(
        &broken(|d| {
            d["extenders"][0].as_object_mut().unwrap().remove("weight");
        }),
        "weight",
    );
    assert_rejected(
        &broken(|d| {
            let e = d["extenders"][0].as_object_mut().unwrap();
            let url = e.remove("urlPrefix").unwrap();
            e.insert("urlprefix".to_owned(), url);
        }),
        "unknown field \"urlprefix\"",
    );
    assert_rejected(&broken(|d| d["schedulerName"] = "gpushare".into()), "unknown field \"schedulerName\"");
    assert_rejected(
        &broken(|d| {
            let second = serde_json::json!({
                "urlPrefix": "http://127.0.0.1:40000/other",
                "bindVerb": "bind",
                "nodeCacheCapable": true,
            });
            d["extenders"].as_array_mut().unwrap().push(second);
        }),
        "only one may bind",
    );
    assert_rejected(&broken(|d| d["apiVersion"] = "kubescheduler.config.k8s.io/v1beta2".into()), "apiVersion");
    assert_rejected(&broken(|d| d["kind"] = "Policy".into()), "kind");
    assert_rejected(
        &broken(|d| {
            d.as_object_mut().unwrap().remove("clientConnection");
        }),
        "clientConnection",
    );
    assert_rejected(&broken(|d| d["clientConnection"]["kubeconfig"] = "scheduler.conf".into()), "absolute");
}

#[test]
fn the_checker_rejects_bad_extender_values() {
    let extender = |key: &'static str, value: Value| broken(move |d| d["extenders"][0][key] = value);
    assert_rejected(&extender("enableHTTPS", true.into()), "enableHTTPS");
    assert_rejected(&extender("urlPrefix", "https://127.0.0.1:39999/gpushare-scheduler".into()), "enableHTTPS");
    assert_rejected(&extender("urlPrefix", "http://127.0.0.1/gpushare-scheduler".into()), "port");
    assert_rejected(&extender("urlPrefix", "127.0.0.1:39999/gpushare-scheduler".into()), "scheme");
    assert_rejected(&extender("httpTimeout", "5".into()), "httpTimeout");
    assert_rejected(&extender("httpTimeout", "five seconds".into()), "httpTimeout");
    assert_rejected(&extender("httpTimeout", 5.into()), "httpTimeout");
    assert_rejected(&extender("nodeCacheCapable", false.into()), "nodeCacheCapable");
    assert_rejected(&extender("tlsConfig", serde_json::json!({"cafile": "/x"})), "unknown field \"cafile\"");

    let resource = |j: usize, key: &'static str, value: Value| {
        broken(move |d| d["extenders"][0]["managedResources"][j][key] = value)
    };
    assert_rejected(&resource(0, "ignoredByScheduler", true.into()), "gpu-mem");
    assert_rejected(&resource(1, "ignoredByScheduler", false.into()), "gpu-count");
    assert_rejected(&resource(1, "name", "gpushare.io/gpu-mem".into()), "twice");
    assert_rejected(&resource(0, "name", "gpu-mem".into()), "domain prefix");
    assert_rejected(&resource(0, "name", "kubernetes.io/gpu-mem".into()), "reserved");
    assert_rejected(&resource(0, "name", "example.k8s.io/gpu-mem".into()), "reserved");
    assert_rejected(&resource(0, "name", "GPUshare.io/gpu-mem".into()), "DNS");
    assert_rejected(&resource(0, "ignoredbyscheduler", false.into()), "unknown field");
}

#[test]
fn go_durations() {
    for good in ["5s", "500ms", "1m", "1m30s", "1.5s", "2h", "100us", "10µs", "250000000ns"] {
        assert!(is_positive_go_duration(good), "{good}");
    }
    for bad in ["", "5", "0s", "-5s", "+5s", "s", "5 s", "5sec", "1..5s", ".s", "5S", "1d"] {
        assert!(!is_positive_go_duration(bad), "{bad}");
    }
}
