//! The daemon binary against the kubelet stand-in: registration, options, the device list and
//! its size limit, re-registration after a daemon restart, clean shutdown, config checks.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use std::collections::BTreeSet;
use std::time::Duration;

use common::{Daemon, Host, NO_API_SERVER, WAIT, healthy_list, static_gpus};
use gpushare_testkit::kubelet::Kubelet;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn registers_and_lists_one_device_per_mib() {
    let host = Host::new();
    let kubelet = Kubelet::start(&host.plugin_dir()).await.unwrap();
    let kubeconfig = host.kubeconfig(NO_API_SERVER);
    let config = host.config(&kubeconfig, "", &static_gpus(&[(1000, Some(0)), (500, Some(1))]));
    let daemon = Daemon::start(&config, host.path("daemon.log"));

    let r = kubelet.wait_registered(1, WAIT).await.unwrap_or_else(|e| panic!("{e}\n{}", daemon.log()));
    assert_eq!(r.version, "v1beta1");
    assert_eq!(r.endpoint, "gpushared.sock");
    assert_eq!(r.resource_name, "gpushare.io/gpu-mem");
    assert!(r.options.unwrap().get_preferred_allocation_available);
    assert!(kubelet.options().unwrap().get_preferred_allocation_available, "options as read back by the kubelet");

    let devices = kubelet.wait_devices(WAIT, |d| !d.is_empty()).await.unwrap();
    assert_eq!(devices.len(), 1500);
    let ids: BTreeSet<&str> = devices.iter().map(|d| d.id.as_str()).collect();
    assert_eq!(ids.len(), 1500, "IDs are unique");
    assert!(devices.iter().all(|d| d.id.len() <= 5 && d.health == "Healthy"));
    let numa: BTreeSet<i64> = devices.iter().map(|d| d.topology.as_ref().unwrap().nodes[0].id).collect();
    assert_eq!(numa, BTreeSet::from([0, 1]));
    assert!(kubelet.largest_message() > 0);
    drop(daemon);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn device_ids_survive_a_daemon_restart_and_it_registers_again() {
    let host = Host::new();
    let kubelet = Kubelet::start(&host.plugin_dir()).await.unwrap();
    let kubeconfig = host.kubeconfig(NO_API_SERVER);
    let config = host.config(&kubeconfig, "", &static_gpus(&[(300, None), (200, None)]));
    let daemon = Daemon::start(&config, host.path("d1.log"));
    kubelet.wait_registered(1, WAIT).await.unwrap();
    let before = kubelet.wait_devices(WAIT, |d| d.len() == 500).await.unwrap();
    daemon.signal("TERM");
    drop(daemon);
    let daemon = Daemon::start(&config, host.path("d2.log"));
    kubelet.wait_registered(2, WAIT).await.unwrap_or_else(|e| panic!("{e}\n{}", daemon.log()));
    // Not the first daemon's list, which the kubelet keeps, turned unhealthy.
    let after = kubelet.wait_devices(WAIT, healthy_list(500)).await.unwrap();
    assert_eq!(before, after);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn waits_for_a_kubelet_that_is_not_up_yet() {
    let host = Host::new();
    let kubeconfig = host.kubeconfig(NO_API_SERVER);
    let config = host.config(&kubeconfig, "", &static_gpus(&[(100, None)]));
    let daemon = Daemon::start(&config, host.path("daemon.log"));
    tokio::time::sleep(Duration::from_millis(700)).await;
    let kubelet = Kubelet::start(&host.plugin_dir()).await.unwrap();
    kubelet.wait_registered(1, WAIT).await.unwrap_or_else(|e| panic!("{e}\n{}", daemon.log()));
    assert!(daemon.log().contains("waiting for the kubelet"), "{}", daemon.log());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stops_cleanly_on_sigterm_and_removes_its_socket() {
    let host = Host::new();
    let kubelet = Kubelet::start(&host.plugin_dir()).await.unwrap();
    let kubeconfig = host.kubeconfig(NO_API_SERVER);
    let config = host.config(&kubeconfig, "", &static_gpus(&[(100, None)]));
    let mut daemon = Daemon::start(&config, host.path("daemon.log"));
    kubelet.wait_registered(1, WAIT).await.unwrap();
    assert!(host.plugin_dir().join("gpushared.sock").exists());
    daemon.signal("TERM");
    assert_eq!(daemon.wait_exit(WAIT), Some(0), "{}", daemon.log());
    assert!(!host.plugin_dir().join("gpushared.sock").exists());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn refuses_a_device_list_over_the_kubelets_limit_naming_the_fix() {
    let host = Host::new();
    let kubeconfig = host.kubeconfig(NO_API_SERVER);
    // 8 x 32 GiB with NUMA at MiB granularity: 262144 devices, well over 4 MiB.
    let gpus: Vec<(u64, Option<u32>)> = (0..8).map(|i| (32_768, Some(i / 4))).collect();
    let config = host.config(&kubeconfig, "", &static_gpus(&gpus));
    let mut daemon = Daemon::start(&config, host.path("daemon.log"));
    assert_eq!(daemon.wait_exit(WAIT), Some(1));
    let log = daemon.log();
    assert!(log.contains("over the kubelet's 4194304-byte message limit"), "{log}");
    assert!(log.contains("unit = \"GiB\""), "{log}");

    // The same node in GiB is served: 256 devices.
    let kubelet = Kubelet::start(&host.plugin_dir()).await.unwrap();
    let config = host.config(&kubeconfig, "", &format!("[resources]\nunit = \"GiB\"\n{}", static_gpus(&gpus)));
    let _daemon = Daemon::start(&config, host.path("daemon2.log"));
    let devices = kubelet.wait_devices(WAIT, |d| !d.is_empty()).await.unwrap();
    assert_eq!(devices.len(), 256);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_largest_mib_node_fits_the_kubelets_receive_limit() {
    // 8 x 26409 MiB (206 GiB) without NUMA topology: the largest 8-GPU node at MiB
    // granularity; the stand-in receives with the kubelet's 4 MiB limit.
    let host = Host::new();
    let kubelet = Kubelet::start(&host.plugin_dir()).await.unwrap();
    let kubeconfig = host.kubeconfig(NO_API_SERVER);
    let gpus: Vec<(u64, Option<u32>)> = (0..8).map(|_| (26_409, None)).collect();
    let config = host.config(&kubeconfig, "", &static_gpus(&gpus));
    let daemon = Daemon::start(&config, host.path("daemon.log"));
    let devices = kubelet
        .wait_devices(Duration::from_secs(30), |d| !d.is_empty())
        .await
        .unwrap_or_else(|e| panic!("{e}\n{:?}\n{}", kubelet.stream_errors(), daemon.log()));
    assert_eq!(devices.len(), 8 * 26_409);
    // Healthy devices encode 2 bytes shorter than the "Unhealthy" worst case the daemon
    // budgets for, so a GPU turning sick can never push the list over the limit.
    assert_eq!(kubelet.largest_message(), 4 * 1024 * 1024 - 112 - 2 * 8 * 26_409);
}

#[test]
fn check_config_exits_zero_or_one_with_the_reason() {
    let host = Host::new();
    let check = |path: &std::path::Path| {
        std::process::Command::new(env!("CARGO_BIN_EXE_gpushared")).arg("--check-config").arg(path).output().unwrap()
    };
    let gpus = static_gpus(&[(1000, None), (1000, None)]);
    let good = host.path("good.toml");
    std::fs::write(&good, format!("node_name = \"node-a\"\n[resources]\nunit = \"GiB\"\n{gpus}")).unwrap();
    let out = check(&good);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    assert_eq!(
        String::from_utf8_lossy(&out.stdout),
        format!(
            "{}: ok (node node-a, 2 GPUs from the static [[gpus]] list of the configuration (NVML not used))\n",
            good.display()
        )
    );
    // Every check the daemon runs at start, not the file's syntax alone: a GPU both in mps and
    // in whole, one this host does not have, and NVML that cannot be loaded.
    let both = host.path("both.toml");
    std::fs::write(&both, format!("node_name = \"node-a\"\n[sharing]\nmps = [1]\nwhole = [1]\n{gpus}")).unwrap();
    let out = check(&both);
    assert_eq!(out.status.code(), Some(1));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("names GPU 1 (GPU-static-1) in mps and whole"), "{err}");
    assert_eq!(err.lines().count(), 1, "{err}");
    let absent = host.path("absent.toml");
    std::fs::write(&absent, format!("node_name = \"node-a\"\n[sharing]\nmps = [7]\n{gpus}")).unwrap();
    let err = String::from_utf8_lossy(&check(&absent).stderr).into_owned();
    assert!(err.contains("[sharing] mps names GPU 7, which this host does not have"), "{err}");
    // Device nodes named to the runtime: one a GPU lacks is noted, not refused.
    let dev = host.path("dev");
    std::fs::create_dir_all(&dev).unwrap();
    std::fs::write(dev.join("nvidia0"), "").unwrap();
    let nodes = host.path("nodes.toml");
    let section = format!("[device_nodes]\nenabled = true\nhost_dir = \"{}\"\n", dev.display());
    std::fs::write(&nodes, format!("node_name = \"node-a\"\n{section}{gpus}")).unwrap();
    let out = check(&nodes);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let notes: Vec<String> = String::from_utf8_lossy(&out.stdout).lines().skip(1).map(str::to_owned).collect();
    assert_eq!(notes.len(), 2, "{notes:?}");
    assert!(notes[0].contains(&format!("{}/nvidia0 is not a character device", dev.display())), "{notes:?}");
    assert!(notes[1].contains("nvidia1") && notes[1].contains("GPU 1 (GPU-static-1)"), "{notes:?}");
    let no_nvml = host.path("no-nvml.toml");
    std::fs::write(&no_nvml, "node_name = \"node-a\"\n[nvml]\nlibrary = \"/nonexistent/libnvidia-ml.so.1\"\n").unwrap();
    let err = String::from_utf8_lossy(&check(&no_nvml).stderr).into_owned();
    assert!(err.contains("cannot use NVML from /nonexistent/libnvidia-ml.so.1"), "{err}");
    let bad = host.path("bad.toml");
    std::fs::write(&bad, "[ledger]\npath = \"ledger.db\"\n").unwrap();
    let out = check(&bad);
    assert_eq!(out.status.code(), Some(1));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("line 2") && err.contains("is relative; write an absolute path"), "{err}");
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_gpushared")).arg("--version").output().unwrap();
    assert_eq!(String::from_utf8_lossy(&out.stdout), format!("gpushared {}\n", env!("CARGO_PKG_VERSION")));
}

#[test]
fn a_missing_config_file_is_said_once() {
    let host = Host::new();
    let missing = host.path("missing.toml");
    let out =
        std::process::Command::new(env!("CARGO_BIN_EXE_gpushared")).arg("--config").arg(&missing).output().unwrap();
    assert_eq!(out.status.code(), Some(1));
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(err.matches(missing.to_str().unwrap()).count(), 1, "{err}");
    assert!(err.starts_with("gpushared: "), "{err}");
}

#[test]
fn nvml_absent_is_a_clear_error_and_a_failure_exit() {
    let host = Host::new();
    let kubeconfig = host.kubeconfig(NO_API_SERVER);
    let config = host.config(&kubeconfig, "", "[nvml]\nlibrary = \"/nonexistent/libnvidia-ml.so.1\"\n");
    let mut daemon = Daemon::start(&config, host.path("daemon.log"));
    assert_eq!(daemon.wait_exit(WAIT), Some(1));
    let log = daemon.log();
    assert!(log.contains("gpushared: cannot use NVML from /nonexistent/libnvidia-ml.so.1"), "{log}");
    assert!(log.contains("list the GPUs under [[gpus]]"), "{log}");
    assert!(!host.plugin_dir().join("gpushared.sock").exists(), "nothing served");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_static_gpu_list_says_so_in_the_log() {
    let host = Host::new();
    let kubelet = Kubelet::start(&host.plugin_dir()).await.unwrap();
    let kubeconfig = host.kubeconfig(NO_API_SERVER);
    let config = host.config(&kubeconfig, "", &static_gpus(&[(100, None)]));
    let daemon = Daemon::start(&config, host.path("daemon.log"));
    kubelet.wait_registered(1, WAIT).await.unwrap();
    assert!(daemon.log().contains("the static [[gpus]] list of the configuration (NVML not used)"), "{}", daemon.log());
}

mod nvml {
    //! Discovery through the fake NVML library, loaded by nvml-wrapper like the real one.

    use super::common::{Daemon, Host, NO_API_SERVER, WAIT};
    use gpushare_testkit::kubelet::Kubelet;
    use gpushare_testkit::nvml::{FakeGpu, build, write_config};

    fn host_with_nvml(gpus: &[FakeGpu], extra: &str) -> (Host, std::path::PathBuf, String) {
        let host = Host::new();
        let lib = build(host.dir.path()).unwrap();
        let nvml_config = host.path("fake-nvml.conf");
        write_config(&nvml_config, gpus, extra).unwrap();
        let kubeconfig = host.kubeconfig(NO_API_SERVER);
        let config = host.config(&kubeconfig, "", &format!("[nvml]\nlibrary = \"{}\"\n", lib.display()));
        (host, config, nvml_config.display().to_string())
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn discovers_gpus_with_their_memory_minor_numa_and_pci() {
        let mut a = FakeGpu::new("h", 0, 300, "Tesla T4");
        a.numa = Some(1);
        let b = FakeGpu::new("h", 1, 200, "NVIDIA A10");
        let (host, config, nvml_config) = host_with_nvml(&[a, b], "driver 560.35.03\n");
        let kubelet = Kubelet::start(&host.plugin_dir()).await.unwrap();
        let daemon = Daemon::start_with_env(&config, host.path("daemon.log"), &[("FAKE_NVML_CONFIG", &nvml_config)]);
        let devices =
            kubelet.wait_devices(WAIT, |d| !d.is_empty()).await.unwrap_or_else(|e| panic!("{e}\n{}", daemon.log()));
        assert_eq!(devices.len(), 500);
        let with_numa = devices.iter().filter(|d| d.topology.as_ref().is_some_and(|t| t.nodes[0].id == 1)).count();
        assert_eq!(with_numa, 300, "GPU0 is on NUMA node 1; GPU1 reports none");
        let log = daemon.log();
        for want in ["source=NVML (", "uuid=GPU-fake-h-0", "model=Tesla T4", "total_mib=300", "model=NVIDIA A10"] {
            assert!(log.contains(want), "missing {want}: {log}");
        }
    }

    #[test]
    fn a_driver_that_is_not_loaded_is_a_clear_error() {
        let (host, config, nvml_config) = host_with_nvml(&[FakeGpu::new("h", 0, 100, "T4")], "init_error 9\n");
        let mut daemon =
            Daemon::start_with_env(&config, host.path("daemon.log"), &[("FAKE_NVML_CONFIG", &nvml_config)]);
        assert_eq!(daemon.wait_exit(WAIT), Some(1));
        let log = daemon.log();
        assert!(log.contains("gpushared: cannot use NVML from"), "{log}");
        assert!(log.contains("install the NVIDIA driver"), "{log}");
    }

    /// A GPU that does not answer at the first start (never seen, so no identity to serve it
    /// under) is named and left out; the others are served, and `--check-config` says the same.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_gpu_that_fails_a_query_is_named_and_the_others_are_served() {
        let gpus = [FakeGpu::new("h", 0, 100, "T4"), FakeGpu::new("h", 1, 100, "T4")];
        let (host, config, nvml_config) = host_with_nvml(&gpus, "gpu_error 1 nvmlDeviceGetUUID 15\n");
        let checked = std::process::Command::new(env!("CARGO_BIN_EXE_gpushared"))
            .arg("--check-config")
            .arg(&config)
            .env("FAKE_NVML_CONFIG", &nvml_config)
            .output()
            .unwrap();
        let out = String::from_utf8_lossy(&checked.stdout);
        assert!(checked.status.success(), "{out}{}", String::from_utf8_lossy(&checked.stderr));
        assert!(out.contains(": ok (node node-a, 1 GPUs from NVML"), "{out}");
        assert!(out.contains("note: GPU1 does not answer (NVML: GPU1 UUID:"), "{out}");
        let kubelet = Kubelet::start(&host.plugin_dir()).await.unwrap();
        let daemon = Daemon::start_with_env(&config, host.path("daemon.log"), &[("FAKE_NVML_CONFIG", &nvml_config)]);
        let devices =
            kubelet.wait_devices(WAIT, |d| !d.is_empty()).await.unwrap_or_else(|e| panic!("{e}\n{}", daemon.log()));
        assert_eq!(devices.len(), 100, "GPU0 only");
        let log = daemon.log();
        assert!(log.contains("GPU1 does not answer (NVML: GPU1 UUID:"), "{log}");
        assert!(log.contains("it is not served until it answers and gpushared restarts"), "{log}");
        drop(daemon);
        let events =
            gpushared::allocation::ledger::Ledger::open(&host.ledger()).unwrap().ledger.events_since(0).unwrap();
        assert!(
            events.iter().any(|e| e.kind == "gpu-lost" && e.detail.starts_with("GPU1 does not answer")),
            "{events:?}"
        );
    }
}

/// `[kubernetes] confine_network`: `--unit-drop-in` prints what the package's generator writes,
/// and a confinement that cannot be made (a server named by host name) is refused by the
/// generator's call, by `--check-config` and by the daemon's start alike, never run without.
#[test]
fn a_confinement_asked_for_is_printed_for_the_generator_or_refused_everywhere() {
    let host = Host::new();
    let run = |args: &[&std::ffi::OsStr]| {
        std::process::Command::new(env!("CARGO_BIN_EXE_gpushared")).args(args).output().unwrap()
    };
    let gpus = static_gpus(&[(1000, None)]);
    let by_address = host.kubeconfig("https://10.9.0.1:6443");
    let config = host.config(&by_address, "", &format!("confine_network = true\n{gpus}"));
    let out = run(&["--config".as_ref(), config.as_os_str(), "--unit-drop-in".as_ref()]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let printed = String::from_utf8_lossy(&out.stdout);
    let settings: Vec<&str> = printed.lines().filter(|l| !l.starts_with('#')).collect();
    assert_eq!(settings, ["[Service]", "IPAddressDeny=any", "IPAddressAllow=10.9.0.1"], "{printed}");
    // Off: the generator gets nothing to write.
    let off = host.config(&by_address, "", &gpus);
    let out = run(&["--config".as_ref(), off.as_os_str(), "--unit-drop-in".as_ref()]);
    assert!(out.status.success() && out.stdout.is_empty(), "{out:?}");

    let by_name = host.kubeconfig("https://api.cluster.example:6443");
    let config = host.config(&by_name, "", &format!("confine_network = true\n{gpus}"));
    for args in [
        vec!["--config".as_ref(), config.as_os_str(), "--unit-drop-in".as_ref()],
        vec!["--check-config".as_ref(), config.as_os_str()],
    ] {
        let out = run(&args);
        assert_eq!(out.status.code(), Some(1), "{args:?}");
        assert!(out.stdout.is_empty(), "{args:?}: {out:?}");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.contains("https://api.cluster.example:6443, which is named by host name"), "{args:?}: {err}");
    }
    let mut daemon = Daemon::start(&config, host.path("daemon.log"));
    assert_eq!(daemon.wait_exit(WAIT), Some(1), "{}", daemon.log());
    assert!(daemon.log().contains("confine_network"), "{}", daemon.log());
    assert!(!host.plugin_dir().join("gpushared.sock").exists(), "it served before refusing");
}
