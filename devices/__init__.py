"""Device profiles (memory, storage, host link, compute, and where each number comes from) and
detection of the current host. Knows nothing about models or policies.
"""

from fate_edge.devices.detect import HostInfo, detect, matching_profile
from fate_edge.devices.profile import DeviceProfile, ProfileError, list_profiles, load_profile

__all__ = ["DeviceProfile", "HostInfo", "ProfileError", "detect", "list_profiles", "load_profile", "matching_profile"]
