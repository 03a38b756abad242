//! README command 1, as a user runs it: `gpushare-box demo` on the sample cluster and workload
//! brings the box up as processes, places the workload and explains it, and (with `--exit`)
//! stops everything; `gpushare-box demo --real` does the same on the real Kubernetes components.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::process::Command;

/// Runs the demo on the sample cluster and workload with `extra` arguments, and checks what it
/// printed and that it left no process behind.
fn sample_demo(extra: &[&str]) -> String {
    let examples = concat!(env!("CARGO_MANIFEST_DIR"), "/../examples");
    let dir = tempfile::tempdir().unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_gpushare-box"))
        .args(["demo", "--exit", "--cluster", &format!("{examples}/cluster.yaml")])
        .args(["--workload", &format!("{examples}/workload.yaml")])
        .args(extra)
        .arg("--dir")
        .arg(dir.path())
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stdout}\n{stderr}");
    // The inspect table, with every node.
    assert!(stdout.contains("GPU0(Allocated/Total)"), "{stdout}");
    for node in ["gpu-node-a", "gpu-node-b", "gpu-node-c"] {
        assert!(stdout.contains(node), "{node}: {stdout}");
    }
    // Every container of the multi-container pod, the init container included, and the 2-GPU one.
    for line in ["fetch-weights (init)", "model", "tokenizer", "trainer"] {
        assert!(stdout.contains(line), "{line}: {stdout}");
    }
    assert!(stdout.contains("NVIDIA_VISIBLE_DEVICES=GPU-fake-"), "{stdout}");
    // The pods that cannot fit wait, each with the scheduler's reason.
    let waiting = stdout.split("Waiting").nth(1).unwrap_or_else(|| panic!("nothing waits: {stdout}"));
    let line = waiting.lines().find(|l| l.contains("team-nlp/big-model")).unwrap_or_else(|| panic!("{stdout}"));
    assert!(line.contains("nodes are available"), "{line}");
    // The pod that asks for "4Gi" is refused at apply, with the number that was meant.
    let refused = stdout.split("Refused at apply").nth(1).unwrap_or_else(|| panic!("nothing refused: {stdout}"));
    let line = refused.lines().find(|l| l.contains("default/wrong-unit")).unwrap_or_else(|| panic!("{stdout}"));
    assert!(line.contains(r#"write "4096""#), "{line}");
    assert!(!waiting.contains("default/wrong-unit"), "{stdout}");
    assert!(stdout.contains("export KUBECONFIG="), "{stdout}");
    // Every process it started is gone: none has the state directory on its command line.
    let needle = dir.path().to_string_lossy().into_owned();
    let leftovers: Vec<String> = std::fs::read_dir("/proc")
        .unwrap()
        .filter_map(|e| std::fs::read(e.ok()?.path().join("cmdline")).ok())
        .map(|c| String::from_utf8_lossy(&c).replace('\0', " "))
        .filter(|c| c.contains(&needle))
        .collect();
    assert!(leftovers.is_empty(), "still running: {leftovers:?}");
    stdout
}

#[test]
fn the_demo_places_the_sample_workload_and_explains_what_waits() {
    sample_demo(&[]);
}

/// The same on the real components: the real kube-scheduler places the workload through the
/// extender and the real kubelets admit it through gpushared; every pod that fits runs, each
/// container created with the GPU of its assignment.
#[test]
fn the_real_demo_places_the_sample_workload_on_real_kubelets() {
    if !gpushare_testkit::realbox::is_root() || !gpushare_testkit::realkube::available() {
        gpushare_testkit::skip_unless_ci("the real demo needs root and the real Kubernetes components");
        return;
    }
    let stdout = sample_demo(&["--real"]);
    assert!(stdout.contains("Settled in "), "{stdout}");
    let received = stdout.split("What each container received:").nth(1).unwrap().split("Waiting").next().unwrap();
    for pod in ["infer-small", "infer-medium", "chat", "train", "notebook", "embed", "vision"] {
        assert!(received.contains(&format!("/{pod} ")), "{pod} did not run: {stdout}");
    }
    // The GPU that fell off the bus (gpu-node-c's GPU 1) got no pod.
    assert!(!received.contains("GPU-fake-gpu-node-c-1"), "{stdout}");
}

/// A Deployment-like workload: 40 pods of the same size, which the extender binds one at a time
/// per node (look-alikes). The demo settles only once they are placed: none is shown waiting for
/// a look-alike's admission as if it did not fit.
#[test]
fn the_demo_settles_only_when_look_alikes_are_placed() {
    let dir = tempfile::tempdir().unwrap();
    let cluster = dir.path().join("cluster.yaml");
    std::fs::write(
        &cluster,
        "unit: MiB\nnodes:\n\
         - {name: gpu-a, address: 10.0.0.21, gpus: [{model: NVIDIA A10, memoryMiB: 23028, count: 4}]}\n\
         - {name: gpu-b, address: 10.0.0.22, gpus: [{model: NVIDIA A10, memoryMiB: 23028, count: 4}]}\n",
    )
    .unwrap();
    let workload = dir.path().join("workload.yaml");
    let pods: Vec<String> = (0..40)
        .map(|i| {
            format!(
                "apiVersion: v1\nkind: Pod\nmetadata: {{name: web-{i:02}, namespace: default}}\nspec:\n  containers:\n\
                 \x20   - name: server\n      image: x\n      resources:\n        limits: {{gpushare.io/gpu-mem: 3500}}\n"
            )
        })
        .collect();
    std::fs::write(&workload, pods.join("---\n")).unwrap();
    let state = dir.path().join("box");
    let out = Command::new(env!("CARGO_BIN_EXE_gpushare-box"))
        .args(["demo", "--exit", "--cluster"])
        .arg(&cluster)
        .arg("--workload")
        .arg(&workload)
        .arg("--dir")
        .arg(&state)
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{stdout}\n{}", String::from_utf8_lossy(&out.stderr));
    assert!(stdout.contains("Settled in "), "{stdout}");
    assert!(!stdout.contains("Waiting"), "look-alikes shown waiting: {stdout}");
    assert_eq!(stdout.matches("NVIDIA_VISIBLE_DEVICES=GPU-fake-").count(), 40, "{stdout}");
}
