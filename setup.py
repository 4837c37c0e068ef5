"""pip installation of the Python library and its console tools.

On a robot the package is built by colcon through CMakeLists.txt (which also
generates the ROS interfaces); this file serves `pip install -e .` on
development machines and CI (see scripts/bootstrap.sh).
"""
from setuptools import find_packages, setup

setup(
    name="lingbot_map_ros",
    version="0.1.0",
    description="LingBot-Map streaming 3D reconstruction as a ROS 2 node",
    license="Apache-2.0",
    python_requires=">=3.10",
    packages=find_packages(include=["lingbot_map_ros", "lingbot_map_ros.*"]),
    package_data={"lingbot_map_ros.kernels": ["csrc/*.cu"]},  # compiled on the GPU machine at first use
    install_requires=["torch>=2.4", "numpy", "safetensors", "Pillow", "tqdm", "lz4"],
    extras_require={
        "gpu": ["flashinfer-python"],
        "hub": ["huggingface_hub"],
        "offline": ["rosbags>=0.11", "av>=14"],  # lingbot-map-replay --bag / --video, --out-bag
        "slam": ["gtsam>=4.2"],  # lingbot_map_ros.slam's pose graph (loop closure)
        "fleet": ["ray>=2.9", "PyYAML", "rosbags>=0.11", "av>=14"],  # lingbot-map-fleet (Ray; YAML manifests)
        "test": ["pytest", "rosbags>=0.11", "av>=14", "gtsam>=4.2", "ray>=2.9", "PyYAML"],
    },
    entry_points={
        "console_scripts": [
            "lingbot-map-replay = lingbot_map_ros.cli.replay:main",
            "lingbot-map-fleet = lingbot_map_ros.cli.fleet:main",
            "lingbot-map-demo = lingbot_map_ros.cli.demo:main",
            "lingbot_map_node = lingbot_map_ros.ros.main:main",
            "image_folder_publisher = lingbot_map_ros.ros.image_folder_publisher:main",
            "keyframe_selector = lingbot_map_ros.ros.keyframe_selector:main",
        ],
    },
)
