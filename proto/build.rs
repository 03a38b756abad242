//! Compiles the kubelet protos with protox (pure Rust; no `protoc` needed) into `OUT_DIR`.

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let files = ["deviceplugin.proto", "podresources.proto"];
    for f in files {
        println!("cargo:rerun-if-changed={f}");
    }
    let fds = protox::compile(files, ["."])?;
    tonic_prost_build::configure().build_client(true).build_server(true).compile_fds(fds)?;
    Ok(())
}
