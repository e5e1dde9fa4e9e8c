"""Protocol buffer definitions (*.proto) and their generated modules.

The *_pb2*.py modules are generated at set-up time (`python -m splitserve.proto.build`,
run by scripts/setup.sh) so they always match the installed protobuf/grpcio runtime.
"""
