//! Compiles the CRI proto of the recording runtime (`proto/cri.proto`) with protox (pure Rust;
//! no `protoc` needed) into `OUT_DIR`.

fn main() -> Result<(), Box<dyn std::error::Error>> {
    println!("cargo:rerun-if-changed=proto/cri.proto");
    let fds = protox::compile(["cri.proto"], ["proto"])?;
    tonic_prost_build::configure().build_client(true).build_server(true).compile_fds(fds)?;
    Ok(())
}
