"""Broker access: the robust connection, failover between nodes, collectives between ranks."""
