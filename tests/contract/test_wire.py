import pytest

from unicache.contract.request_class import RequestClass, Task
from unicache.contract.wire import request_class_from_proto, request_class_to_proto
from unicache.v1 import common_pb2


def test_request_class_round_trips_through_protobuf():
    cls = RequestClass(tenant="t1", session_id="s9", turn=3, task=Task.AGENT, template=True, template_blocks=4, inferred=True)
    assert request_class_from_proto(request_class_to_proto(cls)) == cls


def test_unset_message_is_the_default_single_turn_class():
    assert request_class_from_proto(common_pb2.RequestClass()) == RequestClass()


def test_unknown_task_is_rejected_with_the_valid_choices():
    with pytest.raises(ValueError, match="unknown task 'poetry'"):
        request_class_from_proto(common_pb2.RequestClass(task="poetry"))
