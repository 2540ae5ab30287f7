"""ampviz in the training stacks people use: one module per framework, each importing its framework only
when you import that module (``import ampviz`` loads none of them).

    ampviz.integrations.transformers   AmpvizCallback for ``transformers.Trainer(callbacks=[...])``
    ampviz.integrations.lightning      AmpvizCallback for ``lightning.Trainer(callbacks=[...])``
    ampviz.integrations.accelerate     Recorder built from an ``accelerate.Accelerator`` and what it prepared
    ampviz.integrations.deepspeed      Recorder built from a ``DeepSpeedEngine`` (ZeRO 0-3 gradient partitions)

For example::

    from ampviz.integrations.transformers import AmpvizCallback
    trainer = Trainer(model=model, args=args, train_dataset=data, callbacks=[AmpvizCallback(path="runs/hf.npz")])

Live export to TensorBoard or W&B: ``AmpvizCallback(..., tensorboard="tb/", wandb=True)`` (see ``ampviz.export``).
"""
