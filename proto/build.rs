use tonic_build::manual::{Method, Service};

fn main() {
    // protoc comes from a crate so a fresh machine needs no system package.
    let protoc = protoc_bin_vendored::protoc_bin_path().expect("vendored protoc for this platform");
    // SAFETY: build scripts are single-threaded; nothing else reads the environment here.
    unsafe { std::env::set_var("PROTOC", protoc) };
    println!("cargo:rerun-if-changed=tunnel.proto");
    println!("cargo:rerun-if-changed=build.rs");
    // The messages (prost). `Chunk` is ours (`proto::Chunk`, encoded by `chunk_call`
    // without an intermediate message), so prost does not generate it.
    tonic_prost_build::configure()
        .build_client(false)
        .build_server(false)
        .extern_path(".tunnel.v1.Chunk", "crate::Chunk")
        .compile_protos(&["tunnel.proto"], &["."])
        .expect("compile tunnel.proto");
    // The services' control-plane calls, as tunnel.proto declares them, with prost
    // (`ControlCodec`). The byte streams (Edge.Dial, Edge.Reverse, Peer.Dial) are called
    // and served by `chunk_call`, which frames and decodes their messages without a
    // copy; the generated server hands it those paths first. tests/grpc_interop.rs
    // checks with Python's grpcio, from tunnel.proto alone, that both agree.
    let prost = "crate::ControlCodec";
    let edge = Service::builder()
        .name("Edge")
        .package("tunnel.v1")
        .method(
            Method::builder()
                .name("control")
                .route_name("Control")
                .input_type("super::Control")
                .output_type("super::Control")
                .codec_path(prost)
                .client_streaming()
                .server_streaming()
                .build(),
        )
        .build();
    let peer = Service::builder()
        .name("Peer")
        .package("tunnel.v1")
        .method(
            Method::builder()
                .name("routes")
                .route_name("Routes")
                .input_type("super::PeerHello")
                .output_type("super::RouteUpdate")
                .codec_path(prost)
                .server_streaming()
                .build(),
        )
        .build();
    tonic_build::manual::Builder::new()
        .build_transport(false)
        .compile(&[edge, peer]);
}
