use std::io::Write as _;

use super::*;

fn kubeconfig(server_block: &str) -> tempfile::NamedTempFile {
    let mut f = tempfile::NamedTempFile::new().expect("temp file");
    write!(
        f,
        "apiVersion: v1\nkind: Config\ncurrent-context: node\ncontexts:\n- name: node\n  context:\n    cluster: main\n    user: node\n\
         - name: other\n  context:\n    cluster: other\n    user: node\nclusters:\n- name: other\n  cluster:\n    server: https://192.0.2.99:6443\n\
         - name: main\n  cluster:\n{server_block}users:\n- name: node\n  user: {{}}\n"
    )
    .expect("write");
    f
}

fn server(url: &str) -> tempfile::NamedTempFile {
    kubeconfig(&format!("    server: {url}\n"))
}

#[test]
fn the_current_contexts_server_is_allowed_by_its_address() {
    for (url, want) in [
        ("https://10.9.0.1:6443", "10.9.0.1"),
        ("https://10.9.0.1", "10.9.0.1"),
        ("https://10.9.0.1:6443/prefix", "10.9.0.1"),
        ("https://[fd00::1]:6443", "fd00::1"),
        ("https://[fd00::1]", "fd00::1"),
        ("https://localhost:6443", "localhost"),
        ("https://127.0.0.1:6443", "127.0.0.1"),
    ] {
        let f = server(url);
        assert_eq!(api_server(f.path()).expect(url).to_string(), want, "{url}");
    }
}

#[test]
fn a_server_named_by_host_name_is_refused_with_what_to_do() {
    let f = server("https://api.cluster.example:6443");
    let e = api_server(f.path()).expect_err("a host name");
    let text = e.to_string();
    assert!(text.contains("api.cluster.example"), "{text}");
    assert!(text.contains("host name"), "{text}");
    assert!(text.contains("confine_network = false"), "{text}");
}

#[test]
fn a_server_behind_a_proxy_is_refused() {
    let f = kubeconfig("    server: https://10.9.0.1:6443\n    proxy-url: http://10.0.0.5:3128\n");
    let text = api_server(f.path()).expect_err("a proxy").to_string();
    assert!(text.contains("proxy"), "{text}");
}

#[test]
fn a_kubeconfig_without_a_server_or_unreadable_is_refused() {
    let f = kubeconfig("    insecure-skip-tls-verify: true\n");
    assert!(matches!(api_server(f.path()), Err(ConfineError::NoServer { .. })));
    let text = api_server(Path::new("/nonexistent/kubelet.conf")).expect_err("missing").to_string();
    assert!(text.contains("/nonexistent/kubelet.conf"), "{text}");
}

#[test]
fn a_lone_cluster_is_used_without_a_current_context() {
    let mut f = tempfile::NamedTempFile::new().expect("temp file");
    write!(f, "apiVersion: v1\nkind: Config\nclusters:\n- name: c\n  cluster:\n    server: https://10.1.2.3:6443\n")
        .expect("write");
    assert_eq!(api_server(f.path()).expect("one cluster"), Allowed::Address("10.1.2.3".parse().expect("ip")));
}

#[test]
fn the_drop_in_denies_every_address_but_the_api_servers_and_only_when_asked() {
    let f = server("https://10.9.0.1:6443");
    let config = |confine: &str| {
        let text = format!("[kubernetes]\nkubeconfig = {:?}\n{confine}", f.path().display().to_string());
        Config::parse(&text, Path::new("gpushared.toml")).expect("config")
    };
    assert_eq!(drop_in(&config("")).expect("off by default"), None);
    assert_eq!(drop_in(&config("confine_network = false\n")).expect("off"), None);
    let text = drop_in(&config("confine_network = true\n")).expect("on").expect("a drop-in");
    let settings: Vec<&str> = text.lines().filter(|l| !l.starts_with('#')).collect();
    assert_eq!(settings, ["[Service]", "IPAddressDeny=any", "IPAddressAllow=10.9.0.1"]);
}
