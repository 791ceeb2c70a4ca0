"""Request and response bodies: KServe v2 JSON and binary, MindSpore REST, JSON tensors."""
