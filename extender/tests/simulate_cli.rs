//! The `simulate` command as a user runs it: the binary on the files in `examples/`, and on
//! bad input.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).parent().unwrap().to_path_buf()
}

fn simulate(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_gpushare-extender"))
        .arg("simulate")
        .args(args)
        .current_dir(repo())
        .output()
        .unwrap()
}

fn text(bytes: &[u8]) -> String {
    String::from_utf8(bytes.to_vec()).unwrap()
}

#[test]
fn the_readme_command_places_the_sample_workload() {
    let out = simulate(&["--cluster", "examples/cluster.yaml", "--workload", "examples/workload.yaml"]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let stdout = text(&out.stdout);
    for want in [
        "Placing 9 pods from examples/workload.yaml on 3 nodes (unit MiB, GPU policy binpack, node policy binpack)",
        "team-nlp/chat         placed on gpu-node-a",
        "fetch-weights (init): GPU1 2000 MiB",
        "trainer: GPU0 20000 MiB, GPU1 20000 MiB",
        "team-nlp/big-model    waits: no node fits",
        "gpu-node-c: container \"server\" does not fit: GPU0: 16960 of 40960 MiB free, needs 38000; \
         GPU1: unhealthy (Xid 79) [preemption could make room]",
        "refused: container \"app\": gpushare.io/gpu-mem \"4Gi\"",
        "NAME        IPADDRESS  GPU0(Allocated/Total)  GPU1(Allocated/Total)  GPU2(Allocated/Total)",
        "gpu-node-b  10.0.0.12  20000/23028            20000/23028            21000/23028            0/23028",
        "Allocated/Total GPU Memory In Cluster:\n109000/204752 (53%)\n",
    ] {
        assert!(stdout.contains(want), "missing {want:?} in:\n{stdout}");
    }
}

#[test]
fn policies_and_annotations_are_selectable() {
    let out = simulate(&[
        "--cluster",
        "examples/cluster.yaml",
        "--workload",
        "examples/workload.yaml",
        "--gpu-policy",
        "spread",
        "--node-policy",
        "spread",
        "--show-annotations",
    ]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let stdout = text(&out.stdout);
    // Spread: the first pod goes to the emptiest node, the biggest one.
    assert!(stdout.contains("default/infer-small   placed on gpu-node-b"), "{stdout}");
    assert!(stdout.contains(r#"gpushare.io/assignment: {"v":1,"node":"gpu-node-b","unit":"MiB","containers":[{"name":"server","gpus":[{"index":0,"uuid":"GPU-sim-0001-00","mib":3500}]}]}"#), "{stdout}");
}

#[test]
fn bad_input_gets_one_clear_line_and_a_failure_status() {
    let dir = std::env::temp_dir().join(format!("gpushare-sim-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let bad_cluster = dir.join("cluster.yaml");
    std::fs::write(&bad_cluster, "unit: MiB\nnodes:\n  - name: a\n    gpus: [{model: T4, memoryMiB: -5}]\n").unwrap();
    let cases: &[(&[&str], &str)] = &[
        (&["--cluster", "nope.yaml", "--workload", "examples/workload.yaml"], "reading nope.yaml: No such file"),
        (&["--cluster", bad_cluster.to_str().unwrap(), "--workload", "examples/workload.yaml"], "line 4"),
        (&["--cluster", "examples/cluster.yaml", "--workload", "examples/cluster.yaml"], "workload document 1"),
    ];
    for (args, want) in cases {
        let out = simulate(args);
        assert_eq!(out.status.code(), Some(1), "{args:?}");
        let stderr = text(&out.stderr);
        assert!(stderr.starts_with("gpushare-extender: "), "{stderr}");
        assert!(stderr.contains(want), "{args:?}: {stderr}");
    }
    let out = simulate(&["--cluster", "examples/cluster.yaml", "--workload", "x", "--gpu-policy", "best-fit"]);
    assert_eq!(out.status.code(), Some(2));
    assert!(text(&out.stderr).contains("write \"binpack\" or \"spread\""), "{}", text(&out.stderr));
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn a_reader_that_stops_early_is_not_an_error() {
    // `simulate ... | head -1`: the pipe closes before the output is written.
    let mut child = Command::new(env!("CARGO_BIN_EXE_gpushare-extender"))
        .args(["simulate", "--cluster", "examples/cluster.yaml", "--workload", "examples/workload.yaml"])
        .current_dir(repo())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    drop(child.stdout.take());
    let out = child.wait_with_output().unwrap();
    let err = text(&out.stderr);
    assert!(out.status.success(), "{:?}: {err}", out.status);
    assert!(!err.contains("panicked"), "{err}");
}
