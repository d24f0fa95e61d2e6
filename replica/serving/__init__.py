"""The replica's transports: the gRPC server and the framed hop server, the cluster-key
check that guards both, how a failed call ends, and protobuf <-> engine conversion.
"""
