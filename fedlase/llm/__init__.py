"""Language models in fedlase: LoRA adapters as the trainable set (`adapters.py`; the `lora` key is checked in
fedlase/lora_config.py, beside the other config halves, low in the import graph), the adapter methods that
aggregate them their own way (`lora_methods.py`: HetLoRA, FlexLoRA, FLoRA, LoRA-FedAvg),
and the export of a run's adapter as a peft folder (`export.py`). They plug in as a config
key (its `attach` registered as the `lora` adapters: fedlase.registry.ADAPTERS), methods and a command; the
engine and the client name none of them. docs/llm.md describes them.

Importing this package imports nothing heavy: peft and transformers are imported where an adapter is built."""
