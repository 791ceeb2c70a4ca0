"""shardserve gateway: the HTTP front door (KServe v2 / Open Inference Protocol and
MindSpore Serving REST), talking to the scheduler only through RabbitMQ."""
