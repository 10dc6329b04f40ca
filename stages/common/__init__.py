"""What every stage uses: the config schema (`config`), atomic artifacts and manifests
(`artifacts`), the "same run?" rule (`runs`), messages and progress (`console`), experiment trackers
(`tracking`: TensorBoard, wandb), model loading (`models`), name-derived seeds (`seeds`) and the
user error (`errors`). Nothing here imports
another part of `stages`."""
