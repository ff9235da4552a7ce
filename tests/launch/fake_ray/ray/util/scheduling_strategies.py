class PlacementGroupSchedulingStrategy:
    def __init__(self, placement_group, placement_group_bundle_index):
        self.bundle_index = placement_group_bundle_index
