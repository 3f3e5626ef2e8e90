"""verl's dialect: its RL trainer's keys (actor_rollout_ref.*, ...), its SFT trainer's (for `posttrain sft`) and
its fully asynchronous trainer's, read as posttrain's keys.

    translate(flat, "in run.yaml", command="train")   # one layer's keys -> posttrain's keys, in one pass
    layers, unused = resolve(layers, given)            # all the run's layers: the keys read together

Some of verl's keys are not posttrain's (keys.READ: the ones posttrain takes and does not use, those it takes at
one value only, the deprecated global micro-batch sizes, the fully asynchronous trainer's): translate leaves them in its layer, spelt as an older
posttrain's config.yaml spells them, and resolve reads them over all the run's layers before the merge, takes them
out and adds a layer of the posttrain keys they make.

One job per module, imports going down this list:
    keys.py                the RL trainer's spellings -> posttrain's, and the keys the dialect reads itself (tables;
                           describe: their lines of `posttrain train --help-config`)
    sft.py                 the SFT trainer's spellings -> posttrain sft's
    fully_async.py         the fully asynchronous trainer's async_training.* read into posttrain's asynchronous
                           training (it reads the run's batch sizes: resolve's view of the layers)
    global_sizes.py        verl's deprecated global micro-batch sizes divided over the workers (it reads the run's
                           trainer.nnodes x trainer.n_gpus_per_node: resolve's view of the layers)
    fixed.py               the keys posttrain takes at one value only or names unused, checked (it reads the run's
                           algorithm, checkpoint count and actor's Ulysses size: resolve's view of the layers)
    resolve.py             the keys of keys.READ over all the run's layers: resolve, before the merge
    translate.py           one layer of verl's keys -> posttrain's: translate, the entry point
    rollout_correction.py  algorithm.rollout_correction.* -> the RolloutCorrection settings (algorithms/)
"""

from posttrain.config.dialects.verl.resolve import reads, resolve
from posttrain.config.dialects.verl.translate import translate

__all__ = ["reads", "resolve", "translate"]
