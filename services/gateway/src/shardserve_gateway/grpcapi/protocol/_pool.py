"""The descriptor pool of the generated gRPC code (see scripts/grpc-codegen for why it is
not protobuf's default pool)."""

from google.protobuf import descriptor_pool

POOL = descriptor_pool.DescriptorPool()
