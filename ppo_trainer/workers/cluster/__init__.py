"""Workers on a Ray cluster: the backend, placement on devices and nodes, what nodes must share,
the cluster check and the network interface of the collectives."""
