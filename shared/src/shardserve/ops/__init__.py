"""Running meshes: the shardserve up launcher, the chaos suite, a child-process mesh, warm-up."""
