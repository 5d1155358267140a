"""The network side: the msgpack protocol, the TCP server, mDNS advertise/browse."""
