fn main() {
    // protoc comes from a crate so a fresh machine needs no system package.
    let protoc = protoc_bin_vendored::protoc_bin_path().expect("vendored protoc for this platform");
    // SAFETY: build scripts are single-threaded; nothing else reads the environment here.
    unsafe { std::env::set_var("PROTOC", protoc) };
    println!("cargo:rerun-if-changed=tunnel.proto");
    // Messages (prost) and the gRPC services' clients and servers (tonic).
    tonic_prost_build::configure()
        .compile_protos(&["tunnel.proto"], &["."])
        .expect("compile tunnel.proto");
}
