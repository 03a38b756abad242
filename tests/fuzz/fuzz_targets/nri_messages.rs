//! What the container runtime sends gpushared's NRI plugin: any bytes, cut in two where the
//! first byte says (as two reads of the socket would), are NRI's framing or an error with a
//! message; every whole message that is a ttrpc request gets an answer from the plugin (over a
//! node whose ledger holds one pod's container), which encodes; none panics.
#![no_main]

use std::sync::OnceLock;

use gpushare_core::codec::assignment::{ASSIGNMENT_KEY, Assignment, ContainerAssignment, GpuShare};
use gpushare_core::codec::node::PodRef;
use gpushare_core::{ContainerRole, Gpu, GpuUuid, MemoryUnit, Mib, NodeInventory, ResourceNames};
use gpushare_proto::nri_wire::{Decoder, Message};
use gpushare_proto::ttrpc;
use gpushared::allocation::allocator::Allocator;
use gpushared::allocation::ledger::Ledger;
use gpushared::allocation::pods::{PodStore, PodView};
use gpushared::config::Compatibility;
use libfuzzer_sys::fuzz_target;
use prost::Message as _;

/// One GPU of 16 GiB; pod `default/train` (UID `u1`) holds 1 GiB of it in container `main`.
fn allocator() -> &'static Allocator {
    static ALLOC: OnceLock<(tempfile::TempDir, Allocator)> = OnceLock::new();
    &ALLOC
        .get_or_init(|| {
            let dir = tempfile::tempdir().unwrap();
            let uuid = GpuUuid::new("GPU-fuzz-0".to_owned()).unwrap();
            let gpus = vec![Gpu::new(0, uuid.clone(), "T4", Mib::new(16_384))];
            let inventory = NodeInventory::new(MemoryUnit::Gib, gpus).unwrap();
            let pods = PodStore::new();
            let ledger = Ledger::open(&dir.path().join("ledger.db")).unwrap().ledger;
            let alloc = Allocator::new(
                "fuzz-node".into(),
                ResourceNames::gpushare(),
                Compatibility::Gpushare,
                inventory,
                pods.clone(),
                ledger,
            )
            .unwrap();
            let assignment = Assignment {
                node: "fuzz-node".into(),
                unit: MemoryUnit::Gib,
                containers: vec![ContainerAssignment {
                    name: "main".into(),
                    role: ContainerRole::App,
                    gpus: vec![GpuShare { index: 0, uuid, mib: Mib::new(1024) }],
                }],
            };
            pods.upsert(PodView {
                pod: PodRef { namespace: "default".into(), name: "train".into(), uid: "u1".into() },
                node: Some("fuzz-node".into()),
                created: "2026-12-01T00:00:00Z".into(),
                version: 0,
                terminal: false,
                spec: serde_json::from_value(serde_json::json!({"containers": [{"name": "main",
                    "resources": {"limits": {"gpushare.io/gpu-mem": "1"}}}]}))
                .unwrap(),
                annotations: [(ASSIGNMENT_KEY.to_owned(), assignment.encode().unwrap())].into(),
                container_ids: Vec::new(),
            });
            let free: Vec<String> = alloc.devices().ids(0).collect();
            let ids = alloc.preferred(free.iter().map(String::as_str), &[], 1).unwrap();
            alloc.allocate(&ids).unwrap();
            (dir, alloc)
        })
        .1
}

fn drain(decoder: &mut Decoder) {
    loop {
        match decoder.next_message() {
            Ok(Some(m)) => answer(m),
            Ok(None) => return,
            Err(e) => {
                assert!(!e.to_string().is_empty());
                return;
            }
        }
    }
}

fn answer(m: Message) {
    if let Ok(request) = ttrpc::Request::decode(m.payload.clone()) {
        let response = gpushared::nri::answer(allocator(), &request);
        let status = response.status.as_ref().expect("every answer has a status");
        assert!(status.code == 0 || !status.message.is_empty(), "an error without a message");
        let _ = response.encode_to_vec();
    }
    let _ = ttrpc::Response::decode(m.payload);
}

fuzz_target!(|data: &[u8]| {
    let Some((&cut, bytes)) = data.split_first() else { return };
    let cut = usize::from(cut).min(bytes.len());
    let mut decoder = Decoder::default();
    decoder.push(&bytes[..cut]);
    drain(&mut decoder);
    decoder.push(&bytes[cut..]);
    drain(&mut decoder);
});
