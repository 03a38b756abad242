//! Decoding the kubelet's largest request: a MiB-mode `GetPreferredAllocation` that lists every
//! free device of 8 GPUs × 16 GiB (131 072 IDs in the daemon's format, `Q3`, `Q30`, …), two
//! ways in one run, alternating: `generated`, prost's generated messages (a `String` per ID, what
//! the proto compiles to without `src/compact.rs`), and `compact`, the daemon's
//! ([`DeviceIds`](gpushare_proto::compact::DeviceIds): one buffer, an offset per ID), both from
//! one piece of memory, as tonic hands a message over.
//!
//! Prints each way's median and best time per decode, per ID, and the ratio to `generated`.
//!
//! Run: `cargo bench -p gpushare-proto --bench decode`. Results: BENCHMARKS.md.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::cast_precision_loss)]

use std::hint::black_box;
use std::time::{Duration, Instant};

use gpushare_proto::deviceplugin::PreferredAllocationRequest;
use prost::Message;
use prost::bytes::BytesMut;

const GPUS: u64 = 8;
const UNITS: u64 = 16_384;
const ROUNDS: usize = 40;

/// prost's generated `v1beta1.ContainerPreferredAllocationRequest`.
#[derive(Clone, PartialEq, prost::Message)]
struct GeneratedRequest {
    #[prost(string, repeated, tag = "1")]
    available: Vec<String>,
    #[prost(string, repeated, tag = "2")]
    must: Vec<String>,
    #[prost(int32, tag = "3")]
    size: i32,
}

/// prost's generated `v1beta1.PreferredAllocationRequest`.
#[derive(Clone, PartialEq, prost::Message)]
struct GeneratedEnvelope {
    #[prost(message, repeated, tag = "1")]
    requests: Vec<GeneratedRequest>,
}

/// Device `k` of the GPU tagged `tag`, as the daemon names it: the tag, then `k` in base 62.
fn id(tag: &str, mut k: u64) -> String {
    const ALPHABET: &[u8; 62] = b"0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz";
    let mut digits = Vec::new();
    loop {
        digits.push(ALPHABET[usize::try_from(k % 62).unwrap()]);
        k /= 62;
        if k == 0 {
            break;
        }
    }
    digits.reverse();
    format!("{tag}{}", String::from_utf8(digits).unwrap())
}

fn main() {
    let tags = ["Q3", "b7", "0K", "zz", "M1", "4d", "Xa", "j9"];
    let available: Vec<String> =
        (0..GPUS).flat_map(|g| (0..UNITS).map(move |k| id(tags[usize::try_from(g).unwrap()], k))).collect();
    let ids = available.len();
    let bytes =
        GeneratedEnvelope { requests: vec![GeneratedRequest { available, must: vec![], size: 200 }] }.encode_to_vec();
    println!("GetPreferredAllocation of {ids} free IDs: {} bytes on the wire", bytes.len());

    let ways: [(&str, &dyn Fn() -> usize); 2] = [
        ("generated", &|| {
            GeneratedEnvelope::decode(&mut BytesMut::from(bytes.as_slice())).unwrap().requests[0].available.len()
        }),
        ("compact", &|| {
            PreferredAllocationRequest::decode(&mut BytesMut::from(bytes.as_slice())).unwrap().container_requests[0]
                .available_device_i_ds
                .len()
        }),
    ];
    let mut times: Vec<Vec<Duration>> = vec![Vec::new(); ways.len()];
    for _ in 0..ROUNDS {
        for (i, (_, decode)) in ways.iter().enumerate() {
            let start = Instant::now();
            assert_eq!(black_box(decode()), ids);
            times[i].push(start.elapsed());
        }
    }
    let median = |t: &mut Vec<Duration>| {
        t.sort();
        t[t.len() / 2]
    };
    let base = median(&mut times[0]);
    for ((name, _), t) in ways.iter().zip(&mut times) {
        let m = median(t);
        println!(
            "{name:<16} median {m:>9.3?}  best {:>9.3?}  {:>5.1} ns an ID  {:.2} of generated",
            t[0],
            m.as_nanos() as f64 / ids as f64,
            m.as_secs_f64() / base.as_secs_f64()
        );
    }
}
