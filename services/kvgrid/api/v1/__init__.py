"""Generated protobuf and gRPC code for kvgrid.v1 (regenerate with scripts/gen_proto.py)."""
