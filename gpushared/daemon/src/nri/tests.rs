//! The plugin against a stand-in runtime on a real unix socket, speaking NRI's framing from the
//! runtime's side: registration, configuration, synchronization, container creation, a refused
//! creation, and shutdown; and the connection's errors.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::collections::BTreeMap;

use gpushare_core::ContainerRole;
use tokio::net::UnixListener;

use super::*;
use gpushare_testkit::nri::Runtime;

use crate::allocation::allocator::tests::{Fixture, fixture, fixture_counted, pod};
use crate::config::Compatibility;

/// A node whose pod `u1` holds 350 MiB of GPU 1 in container `main`, the plugin dialling a
/// stand-in runtime: returns the fixture, the runtime's end, and the plugin's task.
async fn connected() -> (Fixture, Runtime, tokio::task::JoinHandle<Result<(), NriError>>, tempfile::TempDir) {
    let f = fixture(Compatibility::Gpushare);
    pod(&f, "u1", "2026-12-01T00:00:00Z", &[("main", ContainerRole::App, &[(1, 350)])]);
    let free: Vec<String> = (0..3).flat_map(|g| f.alloc.devices().ids(g).collect::<Vec<_>>()).collect();
    let ids = f.alloc.preferred(free.iter().map(String::as_str), &[], 350).unwrap();
    f.alloc.allocate(&ids).unwrap();
    connected_to(f).await
}

/// The plugin of `f`'s node dialling a stand-in runtime.
async fn connected_to(
    f: Fixture,
) -> (Fixture, Runtime, tokio::task::JoinHandle<Result<(), NriError>>, tempfile::TempDir) {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("nri.sock");
    let listener = UnixListener::bind(&path).unwrap();
    let config: NriConfig = toml::from_str(&format!("enabled = true\nsocket = {path:?}\nindex = \"07\"")).unwrap();
    let alloc = Arc::clone(&f.alloc);
    let plugin = tokio::spawn(async move { serve(&alloc, &config).await });
    let (socket, _) = listener.accept().await.unwrap();
    (f, Runtime::new(socket), plugin, dir)
}

fn create(uid: &str, name: &str, container: &str, env: &[&str]) -> Vec<u8> {
    api::CreateContainerRequest {
        pod: Some(api::PodSandbox {
            id: "sandbox".into(),
            name: name.into(),
            uid: uid.into(),
            namespace: "default".into(),
        }),
        container: Some(api::Container {
            id: "c".into(),
            pod_sandbox_id: "sandbox".into(),
            name: container.into(),
            env: env.iter().map(|&s| s.to_owned()).collect(),
        }),
    }
    .encode_to_vec()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_runtime_is_told_each_containers_environment_and_refused_another_pods() {
    let (_f, mut runtime, plugin, _dir) = connected().await;
    let registered = runtime.registration(None).await;
    assert_eq!((registered.plugin_name.as_str(), registered.plugin_idx.as_str()), (PLUGIN_NAME, "07"));

    let configure = api::ConfigureRequest { runtime_name: "containerd".into(), ..Default::default() };
    let r = runtime.call("Configure", configure.encode_to_vec()).await;
    assert_eq!(r.status.unwrap().code, 0);
    // CreateContainer alone: bit 4 - 1.
    assert_eq!(api::ConfigureResponse::decode(r.payload.as_slice()).unwrap().events, 0b1000);

    // A split synchronization is acknowledged as split (the runtime drops a plugin that does not).
    for more in [true, false] {
        let r =
            runtime.call("Synchronize", api::SynchronizeRequest { more, ..Default::default() }.encode_to_vec()).await;
        let sync = api::SynchronizeResponse::decode(r.payload.as_slice()).unwrap();
        assert_eq!((sync.more, sync.update.len()), (more, 0));
    }

    // The container's answer was cut short: the rest of its environment is added.
    let lean = ["NVIDIA_VISIBLE_DEVICES=GPU-1", "GPUSHARE_POD=default/pod-u1", "PATH=/bin"];
    let r = runtime.call("CreateContainer", create("u1", "pod-u1", "main", &lean)).await;
    assert_eq!(r.status.unwrap().code, 0);
    let adjust = api::CreateContainerResponse::decode(r.payload.as_slice()).unwrap().adjust.unwrap();
    let added: BTreeMap<String, String> = adjust.env.into_iter().map(|kv| (kv.key, kv.value)).collect();
    assert_eq!(added.get("GPUSHARE_MEMORY_MIB").map(String::as_str), Some("350"), "{added:?}");
    assert!(!added.contains_key("NVIDIA_VISIBLE_DEVICES") && !added.contains_key("PATH"), "{added:?}");

    // A container of another pod that carries this pod's answer does not start.
    let r = runtime.call("CreateContainer", create("u2", "pod-u2", "main", &lean)).await;
    let status = r.status.unwrap();
    assert_eq!(status.code, i32::from(Code::FailedPrecondition));
    assert!(
        status.message.contains("refusing to create container \"main\" of pod default/pod-u2"),
        "{}",
        status.message
    );

    // A container gpushared knows nothing of is left alone.
    let r = runtime.call("CreateContainer", create("u3", "pod-u3", "main", &["PATH=/bin"])).await;
    assert_eq!(api::CreateContainerResponse::decode(r.payload.as_slice()).unwrap(), Default::default());

    // A call it does not serve, and a request that does not decode, are answered with errors.
    assert_eq!(runtime.call("UpdateContainer", Vec::new()).await.status.unwrap().code, i32::from(Code::Unimplemented));
    assert_eq!(runtime.call("CreateContainer", vec![0x0a, 0x05]).await.status.unwrap().code, i32::from(Code::Internal));

    assert_eq!(runtime.call("Shutdown", api::Empty {}.encode_to_vec()).await.status.unwrap().code, 0);
    plugin.await.unwrap().unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refused_registration_and_malformed_framing_end_the_connection_with_the_reason() {
    let (_f, mut runtime, plugin, _dir) = connected().await;
    runtime.registration(Some(ttrpc::Status { code: 6, message: "plugin 07-gpushare already exists".into() })).await;
    let e = plugin.await.unwrap().unwrap_err();
    assert!(matches!(e, NriError::Refused { code: 6, .. }), "{e}");
    assert!(e.to_string().contains("already exists"), "{e}");

    let (_f, mut runtime, plugin, _dir) = connected().await;
    runtime.registration(None).await;
    runtime.socket.write_all(&[0, 0, 0, 0, 0, 0, 0, 1, 0]).await.unwrap();
    let e = plugin.await.unwrap().unwrap_err();
    assert!(e.to_string().contains("malformed framing"), "{e}");

    // The runtime closing the connection ends it quietly; a socket nobody serves is a dial error.
    let (_f, mut runtime, plugin, dir) = connected().await;
    runtime.registration(None).await;
    drop(runtime);
    plugin.await.unwrap().unwrap();
    let config: NriConfig =
        toml::from_str(&format!("enabled = true\nsocket = {:?}", dir.path().join("none.sock"))).unwrap();
    let e = serve(&fixture(Compatibility::Gpushare).alloc, &config).await.unwrap_err();
    assert!(e.to_string().contains("is the runtime running with NRI enabled"), "{e}");
}

/// Where the kubelet counts the memory: a container is allocated as it is created; one whose pod
/// the store lacks (its watch behind) is read from the API server first, and refused, for the
/// kubelet to retry, when that read fails.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn where_the_kubelet_counts_a_container_is_allocated_at_creation_its_pod_read_first() {
    let f = fixture_counted();
    pod(&f, "u1", "2026-12-01T00:00:00Z", &[("main", ContainerRole::App, &[(1, 350)])]);
    // The API server, as the daemon's reads of named pods see it: u2 is bound here, u3 cannot
    // be read.
    let mut fetches = f.alloc.pods().serve_fetches();
    // Weak: the reads end when the allocator, and with it the store's sender, is dropped.
    let answering = Arc::downgrade(&f.alloc);
    let reads = tokio::spawn(async move {
        let mut asked = Vec::new();
        while let Some(fetch) = fetches.recv().await {
            let (namespace, name) = fetch.pods[0].clone();
            asked.push(name.clone());
            let outcome = if name == "pod-u2" {
                let writer = fixture(Compatibility::Gpushare);
                pod(&writer, "u2", "2026-12-01T00:00:01Z", &[("main", ContainerRole::App, &[(0, 200)])]);
                let alloc = answering.upgrade().unwrap();
                alloc.pods().upsert(writer.alloc.pods().get("u2").unwrap().view.clone());
                Ok(true)
            } else {
                Err(format!("pods \"{name}\" in {namespace}: connection refused"))
            };
            let _ = fetch.done.send(outcome);
        }
        asked
    });
    let (f, mut runtime, plugin, _dir) = connected_to(f).await;
    runtime.registration(None).await;
    let env_of = |r: ttrpc::Response| -> BTreeMap<String, String> {
        assert_eq!(r.status.as_ref().unwrap().code, 0, "{:?}", r.status);
        let adjust = api::CreateContainerResponse::decode(r.payload.as_slice()).unwrap().adjust.unwrap();
        adjust.env.into_iter().map(|kv| (kv.key, kv.value)).collect()
    };

    let env =
        env_of(runtime.call("CreateContainer", create("u1", "pod-u1", "main", &["NVIDIA_VISIBLE_DEVICES=all"])).await);
    assert_eq!(env.get("NVIDIA_VISIBLE_DEVICES").map(String::as_str), Some("GPU-1"), "{env:?}");
    assert_eq!(env.get("GPUSHARE_MEMORY_MIB").map(String::as_str), Some("350"), "{env:?}");

    // Not in the store yet: read, then allocated.
    let env = env_of(runtime.call("CreateContainer", create("u2", "pod-u2", "main", &[])).await);
    assert_eq!(env.get("NVIDIA_VISIBLE_DEVICES").map(String::as_str), Some("GPU-0"), "{env:?}");

    // The read fails: refused, nothing allocated.
    let r = runtime.call("CreateContainer", create("u3", "pod-u3", "main", &[])).await;
    let status = r.status.unwrap();
    assert_eq!(status.code, i32::from(Code::Unavailable));
    assert!(status.message.contains("cannot read the pod from the API server"), "{}", status.message);
    assert!(status.message.contains("connection refused"), "{}", status.message);
    let live = f.alloc.live().unwrap();
    assert_eq!(live.iter().map(|r| r.pod.uid.as_str()).collect::<Vec<_>>(), ["u1", "u2"], "{live:?}");

    assert_eq!(runtime.call("Shutdown", api::Empty {}.encode_to_vec()).await.status.unwrap().code, 0);
    plugin.await.unwrap().unwrap();
    drop(f);
    assert_eq!(reads.await.unwrap(), ["pod-u2", "pod-u3"], "the pod in the store is not read again");
}

/// Where the kubelet counts the memory, the runtime is told a container's device nodes, with
/// the numbers of the host's nodes, and on an MPS GPU the pipe directory to bind read-only; a
/// container whose GPU's node the host lacks is refused, naming it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_counted_container_is_given_its_device_nodes_and_mounts_through_the_runtime() {
    let dev = tempfile::tempdir().unwrap();
    // Stand-ins for the driver's nodes: GPU 1 (minor 5), GPU 2 (minor 6) and nvidiactl, each
    // the character device /dev/null is; GPU 0's node (minor 4) is missing.
    for name in ["nvidia5", "nvidia6", "nvidiactl"] {
        std::os::unix::fs::symlink("/dev/null", dev.path().join(name)).unwrap();
    }
    let text = format!("[device_nodes]\nenabled = true\nhost_dir = {:?}\n", dev.path());
    let nodes = crate::config::Config::parse(&text, std::path::Path::new("t.toml")).unwrap().device_nodes;
    let f = crate::allocation::allocator::tests::fixture_mps(Compatibility::Gpushare, &[2], |a| {
        a.with_advertise(crate::config::Advertise::Capacity).with_device_nodes(nodes)
    });
    pod(&f, "u0", "2026-12-01T00:00:00Z", &[("main", ContainerRole::App, &[(0, 100)])]);
    pod(&f, "u1", "2026-12-01T00:00:01Z", &[("main", ContainerRole::App, &[(1, 100)])]);
    pod(&f, "u2", "2026-12-01T00:00:02Z", &[("main", ContainerRole::App, &[(2, 100)])]);
    let (_f, mut runtime, plugin, _dir) = connected_to(f).await;
    runtime.registration(None).await;
    let adjust_of = |r: ttrpc::Response| -> api::ContainerAdjustment {
        assert_eq!(r.status.as_ref().unwrap().code, 0, "{:?}", r.status);
        api::CreateContainerResponse::decode(r.payload.as_slice()).unwrap().adjust.unwrap()
    };
    let devices = |a: &api::ContainerAdjustment| -> Vec<(String, String, i64, i64)> {
        let linux = a.linux.clone().unwrap_or_default();
        linux.devices.into_iter().map(|d| (d.path, d.r#type, d.major, d.minor)).collect()
    };

    let shared = adjust_of(runtime.call("CreateContainer", create("u1", "pod-u1", "main", &[])).await);
    assert_eq!(
        devices(&shared),
        [("/dev/nvidia5".into(), "c".into(), 1, 3), ("/dev/nvidiactl".into(), "c".into(), 1, 3)]
    );
    assert!(shared.mounts.is_empty(), "{shared:?}");

    let mps = adjust_of(runtime.call("CreateContainer", create("u2", "pod-u2", "main", &[])).await);
    assert_eq!(devices(&mps)[0], ("/dev/nvidia6".into(), "c".into(), 1, 3));
    let m = &mps.mounts[0];
    assert_eq!(
        (m.source.as_str(), m.destination.as_str(), m.r#type.as_str()),
        ("/run/nvidia-mps", "/run/nvidia-mps", "bind")
    );
    assert!(m.options.contains(&"ro".to_owned()), "{m:?}");
    assert!(mps.env.iter().any(|kv| kv.key == "CUDA_MPS_PIPE_DIRECTORY"), "{:?}", mps.env);

    let r = runtime.call("CreateContainer", create("u0", "pod-u0", "main", &[])).await;
    let status = r.status.unwrap();
    assert_eq!(status.code, i32::from(Code::FailedPrecondition));
    let missing = dev.path().join("nvidia4");
    assert!(status.message.contains(&missing.display().to_string()), "{}", status.message);

    assert_eq!(runtime.call("Shutdown", api::Empty {}.encode_to_vec()).await.status.unwrap().code, 0);
    plugin.await.unwrap().unwrap();
}
