//! Compiles the kubelet protos, NRI's and ttrpc's envelope with protox (pure Rust; no `protoc`
//! needed) into `OUT_DIR`.

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let files = ["deviceplugin.proto", "podresources.proto", "dra.proto", "pluginregistration.proto"];
    for f in files {
        println!("cargo:rerun-if-changed={f}");
    }
    let fds = protox::compile(files, ["."])?;
    // The large lists are hand-written (src/compact.rs): wire-compatible, cheap in memory.
    tonic_prost_build::configure()
        .build_client(true)
        .build_server(true)
        .extern_path(
            ".v1beta1.ContainerPreferredAllocationRequest",
            "crate::compact::ContainerPreferredAllocationRequest",
        )
        .extern_path(".v1beta1.PreferredAllocationRequest", "crate::compact::PreferredAllocationRequest")
        .extern_path(".v1beta1.ListAndWatchResponse", "crate::compact::ListAndWatchResponse")
        .extern_path(".v1.ContainerDevices", "crate::compact::ContainerDevices")
        .compile_fds(fds)?;
    // NRI's messages and ttrpc's envelope: carried over ttrpc, not gRPC, so no services.
    let ttrpc = ["nri.proto", "ttrpc.proto"];
    for f in ttrpc {
        println!("cargo:rerun-if-changed={f}");
    }
    tonic_prost_build::configure()
        .build_client(false)
        .build_server(false)
        .compile_fds(protox::compile(ttrpc, ["."])?)?;
    Ok(())
}
