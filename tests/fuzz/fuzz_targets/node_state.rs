//! The node-state annotation (and the heartbeat beside it): any text decodes to a state or a
//! clear error, never a panic; a state that decodes encodes and decodes back to itself.
#![no_main]

use gpushare_core::codec::heartbeat::Heartbeat;
use gpushare_core::codec::node::{NodeState, pod_footprints, used_per_gpu};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|text: &str| {
    if let Ok(state) = NodeState::decode(text) {
        let again = NodeState::decode(&state.encode().expect("a decoded state encodes")).expect("and decodes");
        assert_eq!(again.inventory, state.inventory);
        assert_eq!(again.used, state.used);
        assert_eq!(again.allocations.len(), state.allocations.len());
        assert_eq!(again.claims.len(), state.claims.len());
        let _ = pod_footprints(&state.inventory, &state.allocations);
        let used = used_per_gpu(&state.inventory, &state.allocations, &state.claims);
        assert_eq!(used.len(), state.inventory.gpus().len());
    }
    if let Ok(h) = Heartbeat::decode(text) {
        assert_eq!(Heartbeat::decode(&h.encode().expect("encodes")).expect("decodes"), h);
    }
});
