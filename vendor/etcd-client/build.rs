// keel's one change to etcd-client 0.21.1: the .proto files are compiled by protox, a protobuf
// compiler in Rust, instead of the `protoc` binary, so that building keel needs no system package.
// tonic-prost-build then generates the same code from the descriptor set protox returns.

#[cfg(feature = "build-server")]
fn should_build_server() -> bool {
    true
}

#[cfg(not(feature = "build-server"))]
fn should_build_server() -> bool {
    false
}

fn main() {
    let proto_root = "proto";
    println!("cargo:rerun-if-changed={proto_root}");

    let descriptors = protox::compile(
        [
            "proto/etcd/api/authpb/auth.proto",
            "proto/etcd/api/etcdserverpb/rpc.proto",
            "proto/etcd/api/mvccpb/kv.proto",
            "proto/etcd/server/etcdserver/api/v3election/v3electionpb/v3election.proto",
            "proto/etcd/server/etcdserver/api/v3lock/v3lockpb/v3lock.proto",
        ],
        [proto_root],
    )
    .expect("Failed to compile proto files");

    tonic_prost_build::configure()
        .build_server(should_build_server())
        .compile_fds(descriptors)
        .expect("Failed to generate code from proto files");
}
