"""The job lifecycle: job state, SIGTERM, step boundaries, in-process rescale.

Layer below ``stratagem.data`` and ``stratagem.adapt`` (it imports neither): the model,
loaders and training loops take part through the small :class:`Participant` interface,
registered on the process's :class:`JobContext`. Modules:

* ``context``: the :class:`JobContext` (one per process) and membership-change events;
* ``state``: the registry of job states, saved and restored together (checkpoint-restart);
* ``background_save``: periodic checkpoints written by a background thread;
* ``signals``: SIGTERM noted, acted on at the next step boundary;
* ``boundary``: the step boundary (``exit_point``, ``hold_exit``);
* ``rescale``: in-process rescale (workers join and leave a running job);
* ``membership``: what every member runs around a membership change;
* ``epoch``: restart-aware epochs (``remaining_epochs_until``);
* ``wire``: job state between replicas without pickles.

See docs/how-to/elastic-training.md and docs/how-to/in-process-rescale.md.
"""

from stratagem.elastic.background_save import wait_for_checkpoint
from stratagem.elastic.boundary import exit_point, hold_exit
from stratagem.elastic.context import (
    JobContext,
    MembershipChange,
    Participant,
    current_job,
    drop_job,
    job_context,
)
from stratagem.elastic.epoch import current_epoch, finished_epochs, remaining_epochs_until
from stratagem.elastic.rescale import (
    Change,
    ElasticGroup,
    active_group,
    join_job,
    request_leave,
    rescale_point,
)
from stratagem.elastic.signals import EXIT_CODE, exit_requested, request_exit
from stratagem.elastic.state import (
    ENV_ADAPTDL_CHECKPOINT,
    ENV_CHECKPOINT_DIR,
    ObjectState,
    State,
    checkpoint_root,
    load_state,
    register_state,
    registered_states,
    reset_states,
    restore_point,
    save_all_states,
    track_loader,
    track_model,
    unique_name,
)

__all__ = [
    "ENV_ADAPTDL_CHECKPOINT",
    "ENV_CHECKPOINT_DIR",
    "EXIT_CODE",
    "Change",
    "ElasticGroup",
    "JobContext",
    "MembershipChange",
    "ObjectState",
    "Participant",
    "State",
    "active_group",
    "checkpoint_root",
    "current_epoch",
    "current_job",
    "drop_job",
    "exit_point",
    "exit_requested",
    "finished_epochs",
    "hold_exit",
    "job_context",
    "join_job",
    "load_state",
    "register_state",
    "registered_states",
    "remaining_epochs_until",
    "request_exit",
    "request_leave",
    "rescale_point",
    "reset_states",
    "restore_point",
    "save_all_states",
    "track_loader",
    "track_model",
    "unique_name",
    "wait_for_checkpoint",
]
