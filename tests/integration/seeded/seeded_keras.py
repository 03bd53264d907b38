"""A seeded Keras program: `fit` with validation and shuffling, then a custom GradientTape loop,
and eager ops on tf.data's own threads (a `py_function` in a parallel `map`).

Run plain and under `gpu-trace record` by tests/integration/test_program_state.py: the output must
be identical. One program for both, since each TensorFlow start costs seconds.
"""

import hashlib
import os
import random
import threading

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

keras.utils.set_random_seed(0)
x = np.random.rand(64, 8).astype("float32")
y = (x.sum(axis=1) > 4).astype("float32")
model = keras.Sequential(
    [
        keras.Input((8,)),
        keras.layers.Dense(16, activation="relu"),
        keras.layers.Dropout(0.25),
        keras.layers.Dense(1, activation="sigmoid"),
    ]
)
model.compile(optimizer="adam", loss="binary_crossentropy", metrics=["accuracy"])
history = model.fit(x, y, epochs=2, batch_size=16, validation_split=0.25, shuffle=True, verbose=0)
for key, values in sorted(history.history.items()):
    print(key, [float(v).hex() for v in values])

opt = keras.optimizers.SGD(0.1)
for _step in range(3):
    with tf.GradientTape() as tape:
        pred = model(x[:16], training=True)
        loss = tf.reduce_mean(keras.losses.binary_crossentropy(y[:16, None], pred))
    grads = tape.gradient(loss, model.trainable_variables)
    opt.apply_gradients(zip(grads, model.trainable_variables))
    print("tape", float(loss).hex())

weights = b"".join(np.asarray(w).tobytes() for w in model.get_weights())
print("weights", hashlib.sha256(weights).hexdigest())
print("random", random.random().hex(), np.random.rand().hex())
print("tf", float(tf.random.uniform(())).hex())


def plus_one(v):
    return tf.constant(1.0) + v  # eager ops, run on a thread of tf.data's, not of `threading`


mapped = tf.data.Dataset.range(4).map(
    lambda i: tf.py_function(plus_one, [tf.cast(i, tf.float32)], tf.float32),
    num_parallel_calls=2,
)
print("tf.data", [float(v).hex() for v in mapped])
others = sorted(t.name for t in threading.enumerate() if not t.name.startswith("gpu-trace"))
print("threads", threading.Thread().name, others)
