//! The pod assignment annotation: any text decodes to an assignment or a clear error, never a
//! panic; one that decodes encodes and decodes back to itself, and its footprint, first request
//! and check against a pod's containers are total.
#![no_main]

use gpushare_core::codec::assignment::Assignment;
use gpushare_core::request::{ContainerRequest, ContainerRole, PodRequest};
use gpushare_core::{MemoryUnit, Mib};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|text: &str| {
    let Ok(a) = Assignment::decode(text) else { return };
    let again = Assignment::decode(&a.encode().expect("a decoded assignment encodes")).expect("and decodes");
    assert_eq!(again, a);
    let _ = a.footprint();
    let _ = a.first_request();
    let _ = a.request_sizes();
    let main = ContainerRequest::new("main", ContainerRole::App, Mib::new(1000), 1, MemoryUnit::Mib).unwrap();
    let _ = a.check_against(&PodRequest::new(MemoryUnit::Mib, vec![main]));
    assert!(a.same_placement(&a));
});
