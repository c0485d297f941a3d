"""The compile path, one step per module, in the order :func:`autopart.compile` runs them
(:func:`autopart.steps.compile_steps.compile_steps`): choose the plan (``plan_step``: replay
it, or profile and solve, on rank 0 for a torchrun world), capture the model at the plan's
microbatch (``capture_step``), build the stages and hand them to a runtime (``build_step``)."""
