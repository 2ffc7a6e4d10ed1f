"""Test faults for the batch job: a DominoPredictor subclass that the tests pass to
`run_job(cfg, predictor=faulty_predictor(...))`, so the production actor carries no fault code.

Ray workers do not have tests/ on their path: `faulty_predictor` registers this module with Ray's
cloudpickle to be sent by value, and the workers import only its base class, from domino_ray.
"""

from __future__ import annotations

import asyncio
import os
import sys
import tempfile

import ray.cloudpickle

from domino_ray.batch.predictor import DominoPredictor


def faulty_predictor(*, kill_actor_once: str | None = None, crash_engine_on_row=None, hold_row_s: float = 0.0,
                     progress_dir: str | None = None, starts_dir: str | None = None) -> type:
    """A DominoPredictor with these faults:

    - `kill_actor_once` (a marker path): the first actor to finish a row while the file does not exist
      creates it and dies mid-batch (Ray must redo the batch, losing and doubling nothing);
    - `crash_engine_on_row` (a row id): the engine thread raises whenever that row is waiting to be
      admitted (a fatal engine error caused by one row);
    - `hold_row_s`: every finished row stays that long in its actor before the batch may leave, so a test
      can lose a node while its actors hold rows (tiny models finish a whole job in under a second);
    - `progress_dir`: each finished batch (counted in the run's per-actor statistics) touches a file named by
      its Ray node id there, so a test can see which nodes have done work so far;
    - `starts_dir`: each actor start, before it loads the models, creates a file of its own there, so a test can
      count the actors started (also those whose models then fail to load).
    """
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])

    class FaultyPredictor(DominoPredictor):
        def __init__(self, *args, **kwargs):
            if starts_dir is not None:
                os.close(tempfile.mkstemp(dir=starts_dir)[0])
            super().__init__(*args, **kwargs)
            self.poisoned = set()  # engine request ids of the crash_engine_on_row row
            if crash_engine_on_row is not None:
                engine, step = self.loop.engine, self.loop.engine.step

                def step_that_crashes():
                    if any(r.request.request_id in self.poisoned for r in engine.pending):
                        raise RuntimeError("test fault: the engine crashed admitting a row")
                    return step()
                engine.step = step_that_crashes

        async def _run(self, row_id, request):
            if row_id == crash_engine_on_row:
                self.poisoned.add(request.request_id)
            completion = await super()._run(row_id, request)
            if hold_row_s:
                await asyncio.sleep(hold_row_s)
            if kill_actor_once is not None and not os.path.exists(kill_actor_once):
                open(kill_actor_once, "w").close()
                os._exit(1)  # die mid-batch, like a crashed node
            return completion

        async def _generate(self, batch):
            table = await super()._generate(batch)
            if progress_dir is not None:
                open(os.path.join(progress_dir, self.node_id), "w").close()
            return table

    return FaultyPredictor
