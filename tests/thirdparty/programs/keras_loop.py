"""Keras 3 as its guide "Writing a training loop from scratch" trains: a GradientTape and
optimizer.apply(grads, weights), eagerly; then the same kind of model through model.fit."""

import hashlib
import os

os.environ.setdefault("KERAS_BACKEND", "tensorflow")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

keras.utils.set_random_seed(0)
tf.config.experimental.enable_op_determinism()
rng = np.random.default_rng(0)
x = rng.normal(size=(192, 12)).astype("float32")
y = (x[:, 0] + x[:, 1] > 0).astype("int32") + (x[:, 2] > 1).astype("int32")


def make_model():
    inputs = keras.Input(shape=(12,), name="digits")
    h = keras.layers.Dense(32, activation="relu", name="dense_1")(inputs)
    h = keras.layers.Dense(32, activation="relu", name="dense_2")(h)
    return keras.Model(inputs=inputs, outputs=keras.layers.Dense(3, name="predictions")(h))


model = make_model()
optimizer = keras.optimizers.Adam(learning_rate=1e-2)
loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(32)
for epoch in range(2):
    for step, (x_batch, y_batch) in enumerate(dataset):
        with tf.GradientTape() as tape:
            logits = model(x_batch, training=True)
            loss_value = loss_fn(y_batch, logits)
        grads = tape.gradient(loss_value, model.trainable_weights)
        optimizer.apply(grads, model.trainable_weights)
        print("epoch", epoch, "step", step, "loss", float(loss_value).hex())

fitted = make_model()
fitted.compile(optimizer=keras.optimizers.SGD(0.05), loss=loss_fn)
history = fitted.fit(x, y, batch_size=32, epochs=2, shuffle=False, verbose=0)
print("fit", [float(v).hex() for v in history.history["loss"]])
digest = hashlib.sha256()
for m in (model, fitted):
    for w in m.get_weights():
        digest.update(w.tobytes())
print("weights", digest.hexdigest())
